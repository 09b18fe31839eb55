"""The Scheduler: an engine's requests and all that decides where their KV lives (vLLM v1's Scheduler).

It owns the requests by id, the batcher that plans each step, the KV cache manager over the block pool, the
session sequences and the output processor. The engine, the simulator and tests drive it alike: add and
abort requests, schedule() a StepPlan, hand the sampler's tokens back to update_from_output. A finished
request is released in one place (_release). Everything here runs on the engine's thread.
"""

import time
from collections.abc import Callable

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from memory.block_pool import BlockPool
from memory.kv_cache import KVCache, KVLayout
from scheduling.batcher import Batcher
from scheduling.disk_tier import DiskTier
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.output_processor import OutputProcessor, ProcessedStep, emit, finish
from scheduling.outputs import RequestOutput, SamplerOutput
from scheduling.plan import StepPlan
from scheduling.policy import Policy
from scheduling.request import Request
from scheduling.sessions import SequenceStore


class Scheduler:
    def __init__(self, config: EngineConfig, layout: KVLayout, eos_token_ids: tuple[int, ...], *,
                 sliding_window: int = 0, kv_cache: KVCache | None = None,
                 on_release: Callable[[str], None] = lambda request_id: None,
                 decisions: DecisionLog | None = None, disk: DiskTier | None = None):
        """layout: the KV cache's (its num_blocks sizes the pool); kv_cache: its arrays, None where no model
        runs (their shadows and tree moves are then skipped); sliding_window: > 0 only when every layer looks
        back that far; on_release(request_id): drops what else a released request holds (its drafts); disk:
        the prefix cache's disk tier (None: off)."""
        pool = BlockPool(layout.num_blocks)
        block_bytes = layout.bytes_per_token * layout.block_size
        self.sessions = SequenceStore(pool, layout.block_size,
                                      max_pinned_blocks=config.session_kv_bytes // block_bytes)
        self.kv = KVCacheManager(pool, layout, config.enable_prefix_caching, sliding_window,
                                 reclaim=self.sessions.reclaim, kv_cache=kv_cache, disk=disk)
        self.batcher = Batcher(config, self.kv, self.sessions, decisions)
        self.processor = OutputProcessor(self.kv, eos_token_ids, config.jump_forward)
        self.requests: dict[str, Request] = {}  # every request added and not yet released, by id
        self.on_release = on_release

    @property
    def running(self) -> list[Request]:
        return self.batcher.running

    @property
    def waiting(self) -> list[Request]:
        return self.batcher.waiting

    def add(self, req: Request) -> None:
        """Queue a validated request (Engine.make_request); it is scheduled from the next step."""
        self.requests[req.request_id] = req
        self.batcher.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Finish a request with "abort" and release it -> its last output (None: no such request)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        finish(req, "abort")
        self._release(req)
        return emit(req)

    def abort_expired(self) -> list[RequestOutput]:
        """Requests past their deadline (waiting or running) finish with "abort"; their blocks go back."""
        now = time.monotonic()
        expired = [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        return [out for r in expired if (out := self.abort(r.request_id)) is not None]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def waits_on_disk(self) -> bool:
        """Whether every unfinished request waits for its prefix from the disk tier (a step has nothing to
        do until a read ends)."""
        return self.kv.waits_on_disk(self.requests.values())

    def schedule(self) -> StepPlan:
        """The next step's plan under the token budget and the free blocks (drafts are added to it later,
        through the batcher, where budget and blocks are left)."""
        return self.batcher.schedule()

    def update_from_output(self, plan: StepPlan, out: SamplerOutput) -> ProcessedStep:
        """The step's tokens appended (stops checked, detokenized, drafts' KV accepted) and its finished
        requests released -> the step's outputs."""
        processed = self.processor.process(plan, out)
        for req in processed.finished:
            self._release(req)
        return processed

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """A step's wall time, for the pacing of prompt chunks beside decodes."""
        num_decode = sum(s.num_new_tokens for s in plan.scheduled if s.is_decoding)
        self.batcher.pacer.observe(num_decode, plan.num_tokens - num_decode, seconds)

    def apply(self, policy: Policy) -> None:
        """A Policy's batch limits, in force from the next step."""
        self.batcher.token_budget, self.batcher.max_num_seqs = policy.token_budget, policy.max_num_seqs

    def stats(self) -> dict:
        disk = self.kv.disk.stats().as_dict() if self.kv.disk is not None else {}
        return self.batcher.stats() | self.kv.stats(self.batcher.running) | self.sessions.stats() | disk

    def _release(self, req: Request) -> None:
        """A finished request's blocks go back (a session turn's: to its sequence), then its drafts; the
        scheduler forgets it."""
        if req.sequence is not None:
            self.sessions.hold(req)
        self.batcher.remove(req)
        self.on_release(req.request_id)
        del self.requests[req.request_id]
