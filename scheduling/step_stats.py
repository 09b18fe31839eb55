"""Typed stats: what one step did (StepStats) and an engine's running totals of them (EngineTotals).

The engine records a StepStats per step (scheduling/step_record.py builds it); stats(), worker telemetry,
Prometheus metrics and the speculation policy read those records, never engine state.
"""

import time
from dataclasses import dataclass

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
