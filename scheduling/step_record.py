"""A step's StepStats, built from what its stages handed on (kept apart from the records in
scheduling/step_stats.py, which the stages' own records hold)."""

from scheduling.output_processor import ProcessedStep
from scheduling.outputs import SamplerOutput
from scheduling.plan import StepPlan
from scheduling.sampling.structured import StepMasks
from scheduling.step_stats import DraftCounts, StageSeconds, StepStats


def step_stats(plan: StepPlan, out: SamplerOutput | None, processed: ProcessedStep | None,
               seconds: StageSeconds, num_running: int, num_waiting: int, kv_usage: float,
               masks: StepMasks | None = None, num_used_blocks: int = 0) -> StepStats:
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
