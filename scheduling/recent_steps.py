"""What an engine did lately: its steps of the last few seconds, for a live view (the web console's,
`stats()`'s "recent"). Totals since start are EngineTotals'; this answers "now", which a counter read once
cannot."""

import time
from collections import deque
from dataclasses import asdict, dataclass

from scheduling.step_stats import STAGES, StageSeconds, StepStats

WINDOW_S = 5.0  # long enough to smooth a bursty step loop, short enough that a rate falls soon after it stops
MAX_STEPS = 4096  # a bound on memory whatever the step rate (a tiny model steps ~1,000 times a second)


@dataclass(frozen=True)
class RecentFigures:
    window_s: float  # the seconds the figures cover: WINDOW_S, or less since the engine started
    num_steps: int  # steps that ran a batch in that window
    tokens_per_s: float  # generated tokens / window_s
    prompt_tokens_per_s: float  # prefill tokens scheduled / window_s
    stage_seconds: StageSeconds  # the mean step's stages over those steps (zeros when there were none)


class RecentSteps:
    def __init__(self, clock=time.monotonic, window_s: float = WINDOW_S):
        self.clock, self.window_s = clock, window_s
        self.started = clock()
        self._steps: deque[tuple[float, StepStats]] = deque(maxlen=MAX_STEPS)  # (end, stats), oldest first

    def add(self, stats: StepStats) -> None:
        """A step that ran a batch has ended."""
        self._steps.append((self.clock(), stats))

    def figures(self) -> RecentFigures:
        now = self.clock()
        while self._steps and self._steps[0][0] < now - self.window_s:
            self._steps.popleft()
        window_s = max(min(self.window_s, now - self.started), 1e-9)
        steps = [s for _, s in self._steps]
        mean = {stage: sum(getattr(s.seconds, stage) for s in steps) / len(steps) if steps else 0.0
                for stage in STAGES}
        return RecentFigures(window_s, len(steps), sum(s.num_generated_tokens for s in steps) / window_s,
                             sum(s.num_prefill_tokens for s in steps) / window_s, StageSeconds(**mean))

    def as_dict(self) -> dict:
        """figures() as plain data (it crosses to the router and the HTTP server)."""
        return asdict(self.figures())
