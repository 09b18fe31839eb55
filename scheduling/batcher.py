"""The continuous batcher: plans each step under the token budget and the free KV blocks.

Running requests come first (decode tokens and the next chunk of unfinished prefills), then waiting
ones in (priority, arrival) order. When blocks run out, the running request with the lowest priority
and latest arrival is preempted: its blocks are freed and it is recomputed later.
"""

import bisect
from dataclasses import dataclass, field

from cluster_configs.engine_config import EngineConfig
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.request import Request, RequestStatus


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Batcher:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.token_budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.token_budget
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # lowest priority, latest arrival: never already scheduled
                self._preempt(victim, plan)
                if victim is req:
                    break
            else:
                plan.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_new = min(req.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break
            self.kv.record_admission(req)
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.scheduled.append((req, num_new))
            budget -= num_new
        return plan

    def _preempt(self, req: Request, plan: StepPlan) -> None:
        self.kv.free(req)
        req.collected_logits.clear()  # recomputed with the rest
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        plan.preempted.append(req)
        self.add(req)
