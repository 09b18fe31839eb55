"""Typed stats: what one step did (StepStats) and an engine's running totals of them (EngineTotals).

The engine records a StepStats per step; stats(), worker telemetry, Prometheus metrics and the
speculation policy read those records, never engine state.
"""

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (they hold StepStats)
    from scheduling.output_processor import ProcessedStep
    from scheduling.outputs import SamplerOutput
    from scheduling.plan import StepPlan
    from scheduling.sampling.structured import StepMasks

STAGES = ("schedule", "propose", "run", "sample", "process")


@dataclass(frozen=True)
class StageSeconds:
    schedule: float = 0.0  # deadlines, the batcher's plan
    propose: float = 0.0  # choosing draft depths, the proposer's passes, scheduling the drafts
    run: float = 0.0  # the target model's forward
    sample: float = 0.0
    process: float = 0.0  # appending, stops, detokenizing; accepting drafts' KV; finishing

    @property
    def total(self) -> float:
        return sum(getattr(self, s) for s in STAGES)


class StageClock:
    """Times a step's stages one after another: value = clock.lap(stage, value) after each."""

    def __init__(self):
        self._last = time.perf_counter()
        self._seconds = dict.fromkeys(STAGES, 0.0)

    def lap(self, stage: str, value=None):
        now = time.perf_counter()
        self._seconds[stage] += now - self._last
        self._last = now
        return value

    def seconds(self) -> StageSeconds:
        return StageSeconds(**self._seconds)


@dataclass(frozen=True)
class DraftCounts:
    """One speculation method's drafts verified in a step."""

    method: str
    num_drafts: int  # requests that verified drafts
    num_draft_tokens: int
    num_accepted_tokens: int


@dataclass(frozen=True)
class StepStats:
    num_prefill_tokens: int = 0  # scheduled tokens of prompts (chunks, recomputation after preemption)
    num_decode_tokens: int = 0  # scheduled last tokens of decoding requests and their drafts
    num_computed_tokens: int = 0  # tokens whose KV the step kept (rejected drafts not counted)
    num_generated_tokens: int = 0  # output tokens appended
    num_forced_tokens: int = 0  # of those, the ones a grammar forced (jump-forward)
    scheduled_ids: tuple[str, ...] = ()
    preempted_ids: tuple[str, ...] = ()
    num_prefix_lookup_tokens: int = 0  # prompt tokens of the requests admitted, looked up in the prefix cache
    num_prefix_hit_tokens: int = 0  # of those, found there
    drafts: tuple[DraftCounts, ...] = ()  # per method that drafted
    seconds: StageSeconds = StageSeconds()
    num_masked_rows: int = 0  # rows sampled under a grammar's token mask (structured outputs)
    mask_seconds: float = 0.0  # computing those masks, in the mask thread while the forward ran
    mask_wait_seconds: float = 0.0  # of the step's sample stage, waiting for masks the forward did not hide
    # after the step
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0  # fraction of KV blocks in use
    num_used_blocks: int = 0  # KV blocks in use

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


def step_stats(plan: "StepPlan", out: "SamplerOutput | None", processed: "ProcessedStep | None",
               seconds: StageSeconds, num_running: int, num_waiting: int, kv_usage: float,
               masks: "StepMasks | None" = None, num_used_blocks: int = 0) -> StepStats:
    """A step's record from its plan, sampler output and processing (None: nothing was scheduled) and its
    grammar masks (None: no constrained row)."""
    drafts: dict[str, list[int]] = {}  # method -> [requests, draft tokens, accepted]
    for scheduled, sampled in zip(plan.scheduled, out.sampled if out else ()):
        if scheduled.draft_method is not None and sampled is not None:
            counts = drafts.setdefault(scheduled.draft_method, [0, 0, 0])
            counts[0] += 1
            counts[1] += len(scheduled.draft_token_ids)
            counts[2] += sampled.num_accepted_tokens
    num_decode = sum(s.num_new_tokens for s in plan.scheduled if s.is_decoding)
    return StepStats(
        num_prefill_tokens=plan.num_tokens - num_decode, num_decode_tokens=num_decode,
        num_computed_tokens=processed.num_computed_tokens if processed else 0,
        num_generated_tokens=processed.num_generated_tokens if processed else 0,
        num_forced_tokens=processed.num_forced_tokens if processed else 0,
        scheduled_ids=tuple(s.request.request_id for s in plan.scheduled),
        preempted_ids=tuple(r.request_id for r in plan.preempted),
        num_prefix_lookup_tokens=plan.num_prefix_lookup_tokens,
        num_prefix_hit_tokens=plan.num_prefix_hit_tokens,
        drafts=tuple(DraftCounts(m, *c) for m, c in drafts.items()), seconds=seconds,
        num_masked_rows=masks.num_rows if masks else 0, mask_seconds=masks.seconds if masks else 0.0,
        mask_wait_seconds=masks.wait_seconds if masks else 0.0,
        num_running=num_running, num_waiting=num_waiting, kv_usage=kv_usage, num_used_blocks=num_used_blocks)


@dataclass(frozen=True)
class EngineTotals:
    """Sums of an engine's StepStats counters since it started."""

    num_steps: int = 0
    num_scheduled_requests: int = 0  # summed over steps: / num_steps is the mean batch in requests
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_computed_tokens: int = 0
    num_generated_tokens: int = 0
    num_forced_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_lookup_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    num_masked_rows: int = 0
    mask_seconds: float = 0.0
    mask_wait_seconds: float = 0.0

    def plus(self, step: StepStats) -> "EngineTotals":
        return EngineTotals(
            self.num_steps + 1,
            self.num_scheduled_requests + len(step.scheduled_ids),
            self.num_prefill_tokens + step.num_prefill_tokens,
            self.num_decode_tokens + step.num_decode_tokens,
            self.num_computed_tokens + step.num_computed_tokens,
            self.num_generated_tokens + step.num_generated_tokens,
            self.num_forced_tokens + step.num_forced_tokens,
            self.num_preemptions + len(step.preempted_ids),
            self.num_prefix_lookup_tokens + step.num_prefix_lookup_tokens,
            self.num_prefix_hit_tokens + step.num_prefix_hit_tokens,
            self.num_masked_rows + step.num_masked_rows,
            self.mask_seconds + step.mask_seconds,
            self.mask_wait_seconds + step.mask_wait_seconds)

    @property
    def prefix_hit_rate(self) -> float:
        return (self.num_prefix_hit_tokens / self.num_prefix_lookup_tokens if self.num_prefix_lookup_tokens
                else 0.0)
