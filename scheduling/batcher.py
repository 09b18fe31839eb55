"""The continuous batcher: plans each step under the token budget and the free KV blocks.

Running requests come first (decode tokens and the next chunk of unfinished prefills), then waiting
ones in (priority, arrival) order. When blocks run out, the running request with the lowest priority
and latest arrival is preempted: its blocks are freed and it is recomputed later. Draft tokens come
last (`add_drafts`), into what budget and free blocks are left: drafts never preempt anyone.
"""

import bisect
from dataclasses import dataclass, field

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from models.token_tree import TokenTree
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.request import Request, RequestStatus


@dataclass
class StepPlan:
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (request, num_new_tokens), drafts included
    preempted: list[Request] = field(default_factory=list)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> drafts to verify
    draft_trees: dict[str, TokenTree] = field(default_factory=dict)  # request id -> its drafts' tree (not chains)
    token_budget_left: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def decoding(self) -> list[int]:
        """Indices into scheduled of the requests computing only their last token (those may draft)."""
        return [i for i, (req, n) in enumerate(self.scheduled)
                if n == 1 and req.num_computed_tokens + 1 == req.num_tokens and not req.prompt_logits]


class Batcher:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, decisions: DecisionLog | None = None):
        self.token_budget = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = config.max_loras
        self.kv = kv
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.decisions = decisions or DecisionLog()

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
                self._preempt(victim, plan, req, num_new)
                if victim is req:
                    break
            else:
                plan.scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        adapters = {r.adapter_id for r in self.running} - {None}
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not plan.preempted:
            req = self.waiting[0]
            if req.adapter_id is not None and req.adapter_id not in adapters and len(adapters) >= self.max_loras:
                break  # its adapter waits for a LoRA slot: one frees when the last request of another finishes
            cached = self.kv.find_cached_prefix(req)
            num_new = min(req.num_tokens - len(cached) * self.kv.block_size, budget)
            if not self.kv.allocate_slots(req, num_new, cached):
                break
            self.kv.record_admission(req)
            self.waiting.pop(0)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.adapter_id is not None:
                adapters.add(req.adapter_id)
            plan.scheduled.append((req, num_new))
            budget -= num_new
        plan.token_budget_left = budget
        return plan

    def add_drafts(self, plan: StepPlan, index: int, draft_token_ids: list[int], tree: TokenTree | None = None) -> bool:
        """Schedule drafts after plan.scheduled[index]'s last token if budget and free blocks allow (a tree's
        nodes take a slot each, in their order)."""
        req, n = plan.scheduled[index]
        k = len(draft_token_ids)
        if k > plan.token_budget_left or not self.kv.allocate_slots(req, n + k):
            return False
        plan.scheduled[index] = (req, n + k)
        plan.draft_token_ids[req.request_id] = draft_token_ids
        if tree is not None and not tree.is_chain:
            plan.draft_trees[req.request_id] = tree
        plan.token_budget_left -= k
        return True

    def _preempt(self, req: Request, plan: StepPlan, needing: Request, num_new: int) -> None:
        why = (f"no free KV block for {num_new} more tokens of {needing.request_id}; " if needing is not req
               else f"no free KV block for its own {num_new} more tokens; ")
        self.decisions.record("preemption", "recompute", why + f"lowest priority, latest arrival of "
                              f"{len(self.running) + 1} running: its {len(req.block_ids)} blocks freed, its "
                              f"{req.num_computed_tokens} computed tokens recomputed when it is scheduled again",
                              subject=req.request_id)
        self.kv.free(req)
        req.collected_logits.clear()  # recomputed with the rest
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        plan.preempted.append(req)
        self.add(req)
