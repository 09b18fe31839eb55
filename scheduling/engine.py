"""The engine: a Scheduler, a model runner, the sampler and speculation, wired into one step: schedule,
propose drafts, run the model, sample, update the scheduler from the sampled tokens, record the step's
StepStats. Input processing (InputProcessor) runs on the callers' threads, before the step's."""

from collections.abc import Callable
from pathlib import Path

import numba
import numpy as np

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from kernels import resolve_num_threads, threading_decision
from kernels.linear.chunking import linear_tiles
from memory.heap import release_free_heap
from memory.kv_cache import KVCache
from models.decoder import DecoderModel
from models.lora.adapter import LoraAdapter
from models.lora.slots import LoraSlots, slot_dtype
from models.packed.planned_load import load_planned, model_key
from scheduling.disk_tier import DiskTier
from scheduling.input_processor import InputProcessor, Prompt
from scheduling.kv_cache_manager import window_shadows
from scheduling.lora.adapter_store import AdapterStore
from scheduling.lora.planner import LoraPlanner, SharedMerged
from scheduling.model_runner import ModelRunner
from scheduling.output_processor import ProcessedStep
from scheduling.outputs import RequestOutput, SamplerOutput, StepOutput
from scheduling.plan import StepPlan
from scheduling.policy import Policy
from scheduling.recent_steps import RecentSteps
from scheduling.request import Request
from scheduling.sampling.step_sampler import sample_step
from scheduling.sampling.structured import MaskWorker, StepMasks
from scheduling.scheduler import Scheduler
from scheduling.sessions import SequenceStore
from scheduling.speculation.drafting import make_speculation
from scheduling.step_record import step_stats
from scheduling.step_stats import EngineTotals, StageClock, StepStats
from scheduling.tensor_parallel import TensorParallelStart
from scheduling.validation import RequestLimits


class Engine:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None,
                 fetch_adapter: Callable[[str], LoraAdapter] | None = None,
                 shared_merged: SharedMerged | None = None,
                 rank_cpu_ids: tuple[tuple[int, ...], ...] = ()):
        """The one factory of an engine's parts. fetch_adapter: where a worker gets the adapters registered
        elsewhere (AdapterStore.add_remote); it then holds at most max_loras of them. shared_merged: where
        merged LoRA copies are shared with the other workers of a deployment. rank_cpu_ids: the cores of
        tensor-parallel ranks 1, 2, ... (a deployment's group: their NUMA nodes'); (): this process's allowed
        cores split evenly between all ranks."""
        self.config = config = config or EngineConfig()
        self.decisions = DecisionLog()
        # followers load their shards beside ours
        self.ranks = TensorParallelStart(model_path, config, rank_cpu_ids)
        self.disk: DiskTier | None = None  # the prefix cache's disk tier
        try:
            self._build(model_path, config, fetch_adapter, shared_merged)
        except BaseException:
            self.close()  # an engine that failed to start leaves no follower or thread behind
            raise

    def _build(self, model_path: str | Path, config: EngineConfig,
               fetch_adapter: Callable[[str], LoraAdapter] | None,
               shared_merged: SharedMerged | None) -> None:
        self.num_threads = resolve_num_threads(config.num_threads, self.ranks.cpu_ids)
        numba.set_num_threads(self.num_threads)  # thread-local: a thread that steps the engine sets it too
        self.decisions.record("threading", **threading_decision())  # once set_num_threads started them
        tiles = linear_tiles()
        self.decisions.record("tiles", f"x chunk {tiles.x_chunk_bytes >> 10} KiB", tiles.why)
        loaded = load_planned(model_path, config, self.decisions, self.ranks.shard)  # via the packed cache
        self.ranks.wait_ready()
        self.spec, weights, self.tokenizer, self.load_stats = (loaded.spec, loaded.weights, loaded.tokenizer,
                                                               loaded.stats)
        release_free_heap()  # the matrices planning repacked
        s, bs = self.spec, config.block_size
        local = self.ranks.shard.local_spec(s)  # this rank's heads and intermediate rows (all at TP 1)
        self.max_model_len = self.ranks.max_model_len
        self.model = DecoderModel(local, weights, self.max_model_len,
                                  self.ranks.collectives(self.num_threads))
        for i in np.flatnonzero(s.moe_layers):  # where its tokens go, worded when the diagnostics are read
            self.decisions.record("experts", f"top-{s.num_experts_per_tok} of {s.num_experts}",
                                  lambda i=i: self.model.expert_log.describe(i), subject=f"layers.{i}")
        num_blocks = self.ranks.num_blocks
        self.kv_cache = KVCache(s.num_layers, num_blocks, bs, local.num_kv_heads, s.head_dim,
                                config.resolved_kv_dtype, config.kv_dtype_overrides,
                                num_shadows=window_shadows(config))
        window = min(s.layer_windows)  # blocks can be released only if every layer looks back a window
        self.adapters = AdapterStore(s, config.max_lora_rank, config.adapter_roots, fetch=fetch_adapter,
                                     max_loaded=config.max_loras if fetch_adapter else None)
        slots = LoraSlots(s, config.max_loras, config.max_lora_rank,  # this rank's part of each adapter
                          slot_dtype(self.model.weight_dtype, local), self.ranks.shard)
        self.runner = ModelRunner(self.model, self.kv_cache, bs, self.adapters, LoraPlanner(
            slots, self.model.weights.layers, s, config.lora_merge, config.lora_merged_bytes,
            self.model.weight_bytes, shared_merged, self.decisions))
        self.speculation = make_speculation(config, s, self.tokenizer, model_path, self.model,
                                            kv_cache_tokens=num_blocks * bs, decisions=self.decisions)
        self.runner.wants_hidden = self.speculation.needs_hidden
        self.disk = self._disk_tier(model_path, config)
        self.scheduler = Scheduler(config, self.kv_cache.layout, s.eos_token_ids, sliding_window=window,
                                   kv_cache=self.kv_cache, on_release=self.speculation.free,
                                   decisions=self.decisions, disk=self.disk)
        # what make_request validates against (the KV pool fit only when every layer keeps all its KV)
        self.inputs = InputProcessor(RequestLimits(s.vocab_size, self.max_model_len, block_size=bs,
                                                   num_kv_blocks=num_blocks if window <= 0 else None),
                                     self.tokenizer, self.adapters, s.eos_token_ids)
        self.totals = EngineTotals()
        self.recent = RecentSteps()
        self._retiring: set[str] = set()  # retired adapter ids, forgotten when no request uses them
        self.num_adapter_blocks_dropped = 0  # cached prefix blocks of forgotten adapter ids
        self.mask_worker = MaskWorker(s.vocab_size)

    def _disk_tier(self, model_path: str | Path, config: EngineConfig) -> DiskTier | None:
        """The prefix cache's disk tier when config.prefix_cache_dir names one: its blocks are this model's
        (the packed cache's key of it) in this KV layout."""
        if config.prefix_cache_dir is None:
            return None
        layout = self.kv_cache.layout
        sources = config.packed_cache_dir or config.prefix_cache_dir  # (where source hashes are recorded)
        try:
            identity = {"model": model_key(model_path, config, sources),
                        "kv": [layout.num_layers, layout.block_size, layout.n_kv_heads, layout.head_dim,
                               list(layout.layer_dtypes)]}
            tier = DiskTier(config.prefix_cache_dir, config.prefix_cache_disk_bytes, identity, self.kv_cache,
                            self.adapters.digest, busy=lambda: bool(self.scheduler.running))
        except OSError as e:
            raise ValueError(f"prefix_cache_dir={config.prefix_cache_dir!r} cannot be used "
                             f"({e.strerror or e}); point it at a folder this process may write, or leave it "
                             "unset") from None
        self.decisions.record("prefix_cache", "disk tier", f"full KV blocks also kept in "
                              f"{tier.files.folder} ({config.prefix_cache_disk_bytes} bytes at most over "
                              f"{tier.files.root})")
        return tier

    def on_disk_read(self, wake: Callable[[], None]) -> None:
        """wake() is called (on another thread) when a read from the disk tier ends: a request waiting for it
        can be scheduled."""
        if self.disk is not None:
            self.disk.wake = wake

    def finish_disk_reads(self) -> None:
        """The disk tier's reads that ended join the pool now (each schedule does it too): a read whose
        request went away meanwhile holds no block past it."""
        self.scheduler.kv.finish_disk_loads()

    def waits_on_disk(self) -> bool:
        """Whether the engine has requests but none a step can take until a disk read ends."""
        return self.scheduler.waits_on_disk()

    @property
    def sessions(self) -> SequenceStore:
        return self.scheduler.sessions

    def register_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT LoRA adapter; requests name it with adapter=name (other weights under a served name:
        its next version). Raises AdapterError."""
        before = self.adapters.resolve(name)
        self.adapters.register(name, path)
        self._retire_replaced(before, name)

    def compose_adapter(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Register name as a weighted combination of registered adapters. Raises AdapterError."""
        before = self.adapters.resolve(name)
        self.adapters.compose(name, weights, combination)
        self._retire_replaced(before, name)

    def unload_adapter(self, name: str) -> None:
        """Serve the adapter no more: requests that use it finish on its weights, then it is forgotten.
        AdapterError if no adapter has that name."""
        self.retire_adapters([self.adapters.unload(name)])

    def retire_adapters(self, adapter_ids: list[str]) -> None:
        """Forget each id (its weights, slot, merged copy, cached prefix blocks) once no request uses it."""
        for adapter_id in adapter_ids:
            self.adapters.retire(adapter_id)
            self._retiring.add(adapter_id)
        self._forget_unused()

    def _retire_replaced(self, before: str | None, name: str) -> None:
        if (retired := self.adapters.replaced(before, name)) is not None:
            self.retire_adapters([retired])

    def _forget_unused(self) -> None:
        if not self._retiring:
            return
        in_use = {r.adapter_id for r in self.scheduler.requests.values()}
        for adapter_id in self._retiring - in_use:
            self.adapters.forget(adapter_id)
            self.runner.lora.forget(adapter_id)
            self.num_adapter_blocks_dropped += self.scheduler.kv.pool.drop_cached(
                lambda extra, a=adapter_id: extra[0] == a)
        self._retiring &= in_use

    def close(self) -> None:
        """Stops the other ranks' processes (tensor parallelism) and the disk tier's threads (what they were
        writing is written first). Idempotent."""
        self.ranks.close()
        if self.disk is not None:
            self.disk.close()

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                    **options) -> Request:
        """make_request(request_id, prompt, params, **options), then submit it."""
        req = self.make_request(request_id, prompt, params, **options)
        self.submit(req)
        return req

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None,
                     **options) -> Request:
        """A validated request, not yet queued (options: InputProcessor.make_request's adapter, cache_salt,
        prompt_logits, pooling, remote_adapter): every InvalidRequest is raised here, before any work."""
        if request_id in self.scheduler.requests:
            raise InvalidRequest(f"request id {request_id!r} is already running; use a unique id")
        return self.inputs.make_request(request_id, prompt, params, **options)

    def submit(self, req: Request) -> None:
        self.scheduler.add(req)
        if req.adapter_id in self.adapters.retired:  # admitted before its adapter was retired
            self._retiring.add(req.adapter_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        out = self.scheduler.abort(request_id)
        self._forget_unused()
        return out

    def abort_expired(self) -> list[RequestOutput]:
        return self.scheduler.abort_expired()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> StepOutput:
        self.ranks.pin_stepping_thread()
        clock = StageClock()
        expired = self.scheduler.abort_expired()
        plan = clock.lap("schedule", self.scheduler.schedule())
        plan = clock.lap("propose", self.speculation.propose(plan, self.scheduler.batcher))
        if not plan.scheduled:
            return StepOutput(expired, self._record(plan, None, None, clock))
        started = self.mask_worker.start(plan)  # grammar masks computed while the model runs
        run = clock.lap("run", self.runner.run(plan))
        masks = self.mask_worker.result(started)
        out = clock.lap("sample", sample_step(plan, run, masks.masks if masks is not None else None,
                                              self.spec.eos_token_ids))
        processed = clock.lap("process", self.scheduler.update_from_output(plan, out))
        stats = self._record(plan, out, processed, clock, masks)
        self.scheduler.observe(plan, stats.seconds.total)
        self.speculation.observe(plan, run, out, stats)
        self._forget_unused()
        return StepOutput(expired + processed.outputs, stats)

    def _record(self, plan: StepPlan, out: SamplerOutput | None, processed: ProcessedStep | None,
                clock: StageClock, masks: StepMasks | None = None) -> StepStats:
        sched = self.scheduler
        stats = step_stats(plan, out, processed, clock.seconds(), len(sched.running), len(sched.waiting),
                           sched.kv.usage, masks, sched.kv.pool.num_used_blocks)
        self.totals = self.totals.plus(stats)
        if plan.scheduled:
            self.recent.add(stats)
        return stats

    def apply(self, policy: Policy) -> None:
        """A scheduler's Policy: batch limits from the next step, speculation's policies."""
        self.scheduler.apply(policy)
        if policy.speculation is not None:
            self.speculation.push_policies(policy.speculation)

    def stats(self) -> dict:
        totals = self.totals
        return self.scheduler.stats() | {
            "num_steps": totals.num_steps, "num_scheduled_requests": totals.num_scheduled_requests,
            "num_prefill_tokens": totals.num_prefill_tokens,
            "prefix_hit_rate": totals.prefix_hit_rate, "num_prefix_hit_tokens": totals.num_prefix_hit_tokens,
            "num_preemptions": totals.num_preemptions,
            "num_generated_tokens": totals.num_generated_tokens,
            "num_forced_tokens": totals.num_forced_tokens,
            "num_masked_rows": totals.num_masked_rows, "mask_seconds": totals.mask_seconds,
            "mask_wait_seconds": totals.mask_wait_seconds,
            "tensor_parallel": self.ranks.stats(self.model.weight_bytes, self.kv_cache.nbytes),
            "num_adapter_blocks_dropped": self.num_adapter_blocks_dropped,
            "recent": self.recent.as_dict(),
        } | self.adapters.stats() | self.runner.lora.stats() | self.speculation.stats()
