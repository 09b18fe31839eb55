"""A modelled worker: one engine's real Scheduler (block pool, KV cache manager, batcher, session store,
output processor) and speculator, stepped in simulated time; the model's forward is replaced by
StepCostModel's seconds and the sampler by SimProposer.sample.

Engine.step in two halves, `plan_step` (schedule, propose drafts, price the step) at the step's start and
`finish_step` (sample, update the scheduler, feed speculation its figures) at its end. The Scheduler is
built over a KVLayout of the modelled model's shape, without KV arrays. The worker loop's telemetry
(actors/worker_hooks.py's _StepMeter and _report) is mirrored by `telemetry`.
"""

from collections import OrderedDict
from types import SimpleNamespace

from cluster_configs.engine_config import EngineConfig
from memory.kv_cache import kv_layout
from numaserve.simulate.sim_proposer import SimProposer
from numaserve.simulate.step_cost import StepCostModel, StepShape, prefill_pairs
from numaserve.simulate.tensor_parallel import TensorParallelStepCost
from scheduling.batcher import Batcher
from scheduling.kv_cache_manager import num_kv_blocks
from scheduling.outputs import RequestOutput
from scheduling.plan import StepPlan
from scheduling.policy import Policy, StepTelemetry
from scheduling.request import Request
from scheduling.scheduler import Scheduler
from scheduling.speculation.drafting import NoSpeculation
from scheduling.speculation.speculator import Speculator

# the KV geometry of the TinyLlama shape (benchmarks/checkpoints.py): 22 layers, 4 KV heads of 64
MODEL_SHAPE = SimpleNamespace(num_layers=22, num_kv_heads=4, head_dim=64)


def step_shape(plan: StepPlan) -> StepShape:
    """A decoding request's row and its draft rows each attend to its context; a prefill chunk's tokens to the
    computed slots and to each other."""
    decode = prefill = drafts = context = pairs = 0
    for s in plan.scheduled:
        computed = s.request.num_computed_tokens
        drafts += len(s.draft_token_ids)
        if s.is_decoding:
            decode += 1
            context += computed * (1 + len(s.draft_token_ids))
        else:
            prefill += s.num_base_tokens
            pairs += prefill_pairs(s.num_base_tokens, computed)
    return StepShape(decode, prefill, drafts, context, pairs)


class SimWorker:
    def __init__(self, worker_id: str, config: EngineConfig, cost: StepCostModel | TensorParallelStepCost,
                 sampler: SimProposer, max_model_len: int, tensor_parallel: int = 1):
        self.worker_id, self.config, self.cost, self.sampler = worker_id, config, cost, sampler
        if config.speculation.enabled:
            self.speculation = Speculator(config.speculation, sampler)
            self.speculation.clock = lambda: 0.0  # the proposer's seconds are its modelled last_passes
        else:
            self.speculation = NoSpeculation()
        # a rank's pool: its KV heads, as many blocks (no arrays, so no recent window)
        m = SimpleNamespace(num_layers=MODEL_SHAPE.num_layers, head_dim=MODEL_SHAPE.head_dim,
                            num_kv_heads=max(1, MODEL_SHAPE.num_kv_heads // tensor_parallel))
        layout = kv_layout(m.num_layers, num_kv_blocks(m, config, max_model_len), config.block_size,
                           m.num_kv_heads, m.head_dim, config.resolved_kv_dtype, config.kv_dtype_overrides)
        # trace tokens are never eos (max_tokens ends a request); a session's turns share KV by prefix
        self.scheduler = Scheduler(config, layout, eos_token_ids=(), on_release=self.speculation.free)
        self.adapters: OrderedDict[str, None] = OrderedDict()  # held (at most max_loras), least recent first
        self.busy = False
        self.num_preemptions = 0
        self.num_generated_tokens = 0
        self.num_prefix_lookup_tokens = self.num_prefix_hit_tokens = 0
        self.cached_on_admission: dict[str, int] = {}  # request id -> its prefix-cache tokens when admitted
        self._meter_steps = self._meter_tokens = 0
        self._meter_seconds = 0.0

    @property
    def batcher(self) -> Batcher:
        """The scheduler's batcher (speculation schedules its drafts through it)."""
        return self.scheduler.batcher

    def submit(self, req: Request) -> None:
        self.scheduler.add(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def apply(self, policy: Policy) -> None:
        """A scheduler's Policy, as Engine.apply applies it."""
        self.scheduler.apply(policy)
        if policy.speculation is not None:
            self.speculation.push_policies(policy.speculation)

    def holds_adapter(self, adapter: str) -> bool:
        """Whether a request with this adapter enters at once (else it waits for the adapter's fetch first);
        the adapter is held from now, least recently used dropped past max_loras."""
        held = adapter in self.adapters
        self.adapters[adapter] = None
        self.adapters.move_to_end(adapter)
        if len(self.adapters) > self.config.max_loras:
            self.adapters.popitem(last=False)
        return held

    def plan_step(self) -> tuple[StepPlan, float]:
        """Schedule and draft the next step -> (its plan, its modelled seconds)."""
        plan = self.scheduler.schedule()
        plan = self.speculation.propose(plan, self.batcher)
        self.num_preemptions += len(plan.preempted)
        self.num_prefix_lookup_tokens += plan.num_prefix_lookup_tokens
        self.num_prefix_hit_tokens += plan.num_prefix_hit_tokens
        for s in plan.scheduled:
            self.cached_on_admission.setdefault(s.request.request_id, s.request.num_cached_tokens)
        return plan, self.cost.seconds(step_shape(plan)) + self._draft_seconds()

    def _draft_seconds(self) -> float:
        """The proposer's modelled seconds this step (its passes, whether their drafts fit or not)."""
        if not isinstance(self.speculation, Speculator):
            return 0.0
        return sum(s for _, s in self.speculation.draft_passes)

    def finish_step(self, plan: StepPlan, seconds: float) -> list[RequestOutput]:
        """The step's outputs, its state moved on as Engine.step moves it."""
        out = self.sampler.sample(plan)
        processed = self.scheduler.update_from_output(plan, out)
        self.scheduler.observe(plan, seconds)
        if isinstance(self.speculation, Speculator):
            draft_seconds = self._draft_seconds()
            self.speculation.record(plan, out, seconds - draft_seconds, draft_seconds,
                                    len(self.scheduler.waiting), self.scheduler.kv.usage)
        self.num_generated_tokens += processed.num_generated_tokens
        self._meter_steps += 1
        self._meter_tokens += plan.num_tokens
        self._meter_seconds += seconds
        return processed.outputs

    def telemetry(self) -> StepTelemetry:
        """This interval's report (actors/worker.py's _report), the meter reset."""
        mean_step_s = self._meter_seconds / self._meter_steps if self._meter_steps else 0.0
        t = StepTelemetry(self.worker_id, len(self.scheduler.running), len(self.scheduler.waiting),
                          self._meter_steps, self._meter_tokens, mean_step_s, self.scheduler.kv.usage,
                          self.num_preemptions, self.speculation.telemetries())
        self._meter_steps = self._meter_tokens = 0
        self._meter_seconds = 0.0
        return t
