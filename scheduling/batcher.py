"""The continuous batcher: plans each step under the token budget and the free KV blocks.

Requests are ordered by arrival under the "fcfs" scheduling policy, by (priority, arrival) under
"priority" (lower first). Running requests come first (decode tokens and the next chunk of unfinished
prefills), then waiting ones in that order. When blocks run out, the last running request in that order
is preempted: its blocks are freed and it is recomputed later. Under "priority" a waiting request that
finds no room (no free blocks, or max_num_seqs running) also preempts running requests of a lower
priority (a higher number), last first, as vLLM's priority preemption does. Draft tokens come last
(`add_drafts`), into what budget and free blocks are left: drafts never preempt anyone. While requests
decode, the prompt tokens of a step (chunks of running prefills, admissions) are bounded by the pacer
(scheduling/prefill_pacing.py) too.
"""

import bisect
from dataclasses import replace

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from models.proposers.token_tree import TokenTree
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.plan import ScheduledRequest, StepPlan
from scheduling.prefill_pacing import PrefillPacer
from scheduling.request import Request, RequestStatus
from scheduling.sessions import SequenceStore


def decodes(req: Request) -> bool:
    """Whether a running request computes only its last token next (ScheduledRequest.is_decoding)."""
    return not req.prompt_only and req.num_computed_tokens + 1 == req.num_tokens


def prompt_tokens(scheduled: list[ScheduledRequest]) -> int:
    """The tokens of those scheduled that are not decode tokens (prefill chunks, recomputes): what pacing
    bounds."""
    return sum(s.num_new_tokens for s in scheduled if not s.is_decoding)


class Batcher:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, sessions: SequenceStore,
                 decisions: DecisionLog | None = None, pacer: PrefillPacer | None = None):
        self.token_budget = config.max_num_batched_tokens
        self.pacer = pacer or PrefillPacer(config.max_prefill_stretch)
        self.max_num_seqs = config.max_num_seqs
        self.max_loras = config.max_loras
        self.kv = kv
        self.sessions = sessions  # a session turn takes its sequence's blocks when admitted
        self.by_priority = config.scheduling_policy == "priority"
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.decisions = decisions or DecisionLog()
        self.floor_over_stretch = False  # the pacer's, as last logged

    def stats(self) -> dict:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "token_budget": self.token_budget, "max_num_seqs": self.max_num_seqs}

    def sort_key(self, req: Request) -> tuple[int, int]:
        """The scheduling order: lower first."""
        return (req.priority if self.by_priority else 0), req.arrival

    def add(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=self.sort_key)

    def remove(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)

    def schedule(self) -> StepPlan:
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        budget, prompt_limit = self._schedule_running(scheduled, preempted)
        prompt_left = prompt_limit - prompt_tokens(scheduled)
        adapters = {r.adapter_id for r in self.running} - {None}
        num_lookup = num_hit = 0
        short_of_blocks = bool(preempted)
        self.kv.finish_disk_loads()
        w = 0  # the first waiting request not skipped: those reading their prefix from disk wait, others pass
        while w < len(self.waiting) and budget > 0 and prompt_left > 0:
            req = self.waiting[w]
            if self.kv.is_loading(req):
                w += 1
                continue
            if short_of_blocks and not self._outranks_running(req):
                break  # admitting it would only preempt again
            if (req.adapter_id is not None and req.adapter_id not in adapters
                    and len(adapters) >= self.max_loras):
                # its adapter waits for a LoRA slot: one frees when the last request of another finishes
                break
            self.sessions.resume(req)
            if self.kv.start_disk_load(req):
                w += 1
                continue
            cached = self.kv.find_cached_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens - len(cached) * self.kv.block_size, budget,
                          prompt_left)
            if len(self.running) >= self.max_num_seqs or not self.kv.allocate_slots(req, num_new, cached):
                self.sessions.suspend(req)
                if not self._preempt_for(req, scheduled, preempted):
                    break
                budget = self.token_budget - sum(s.num_new_tokens for s in scheduled)
                prompt_left = prompt_limit - prompt_tokens(scheduled)
                adapters = {r.adapter_id for r in self.running} - {None}
                continue
            if self.kv.looks_up(req):
                num_lookup, num_hit = num_lookup + req.num_tokens, num_hit + req.num_cached_tokens
            self.waiting.pop(w)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.adapter_id is not None:
                adapters.add(req.adapter_id)
            scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new
            prompt_left -= prompt_tokens(scheduled[-1:])
        return StepPlan(tuple(scheduled), tuple(preempted), budget, num_lookup, num_hit)

    def _schedule_running(self, scheduled: list[ScheduledRequest],
                          preempted: list[Request]) -> tuple[int, int]:
        """The running requests' next tokens, in order (a decode token, or a prefill's next chunk within the
        prompt tokens the pacer leaves), preempting the last in order when blocks run out -> (token budget
        left, the step's bound on prompt tokens: the pacer's, or the whole budget)."""
        budget = self.token_budget
        self.running.sort(key=self.sort_key)
        paced = self.pacer.prompt_tokens(sum(map(decodes, self.running)))
        # (a count with no decode step measured has no room to price the floor against: it waits for one)
        if paced is not None and self.pacer.room_s is not None and (self.pacer.floor_over_stretch
                                                                    != self.floor_over_stretch):
            self._log_pacing()
        prompt_limit = prompt_left = budget if paced is None else paced
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chunk = not decodes(req)
            if chunk and prompt_left == 0:  # its next chunk waits for a step with room
                i += 1
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget, prompt_left if chunk else budget)
            while not self.kv.allocate_slots(req, num_new):
                victim = self.running.pop()  # last in order: never already scheduled
                self._preempt(victim, preempted, f"no free KV block for {num_new} more tokens of "
                              + ("its own" if victim is req else req.request_id))
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                prompt_left -= prompt_tokens(scheduled[-1:])
                i += 1
        return budget, prompt_limit

    def _log_pacing(self) -> None:
        """When a one-token prompt chunk alone comes to exceed what max_prefill_stretch allows, or no longer
        does: the decision log says so (a warning while it does)."""
        self.floor_over_stretch = over = self.pacer.floor_over_stretch
        pacer, token_s = self.pacer, self.pacer.token_s or 0.0
        self.decisions.record(
            "prefill_pacing", "floor over the stretch" if over else "within the stretch",
            f"a step with a one-token prompt chunk costs {pacer.floor_s * 1e3:.1f} ms over a "
            f"{pacer.decode_s * 1e3:.1f} ms decode step (recent chunks: {token_s * 1e3:.2f} ms a prompt "
            f"token); max_prefill_stretch {pacer.max_stretch:g} leaves {pacer.room_s * 1e3:.1f} ms"
            + ("; chunks are sized to stretch that floor instead (raise max_prefill_stretch to hold it)"
               if over else ""), warn=over)

    def with_drafts(self, plan: StepPlan, drafts: dict[int, TokenTree], method: str) -> StepPlan:
        """plan with drafts after the last token of plan.scheduled[i] for each i in drafts, in order, where
        budget and free blocks allow (a tree's nodes take a slot each, in their order)."""
        scheduled, budget = list(plan.scheduled), plan.token_budget_left
        for i, tree in sorted(drafts.items()):
            s, k = scheduled[i], len(tree.tokens)
            if k > budget or not self.kv.allocate_slots(s.request, s.num_new_tokens + k):
                continue
            scheduled[i] = replace(s, num_new_tokens=s.num_new_tokens + k, draft_token_ids=tree.tokens,
                                   tree=None if tree.is_chain else tree, draft_method=method)
            budget -= k
        return replace(plan, scheduled=tuple(scheduled), token_budget_left=budget)

    def _preempt_for(self, waiting: Request, scheduled: list[ScheduledRequest],
                     preempted: list[Request]) -> bool:
        """Under "priority", when waiting finds no room: preempt the running request last in order if its
        priority is lower, and drop it from this step's scheduled requests. -> whether one was. (Requests
        admitted this step sit unsorted at the end of running.)"""
        if not self._outranks_running(waiting):
            return False
        victim = max(self.running, key=self.sort_key)
        self.running.remove(victim)
        scheduled[:] = [s for s in scheduled if s.request is not victim]
        self._preempt(victim, preempted, f"waiting {waiting.request_id} of priority {waiting.priority} found "
                      "no room")
        return True

    def _outranks_running(self, waiting: Request) -> bool:
        """Under "priority": whether a running request has a lower priority (a higher number) than waiting."""
        return self.by_priority and any(r.priority > waiting.priority for r in self.running)

    def _preempt(self, req: Request, preempted: list[Request], why: str) -> None:
        self.decisions.record("preemption", "recompute", why + "; last in scheduling order of "
                              f"{len(self.running) + 1} running: its {len(req.block_ids)} blocks freed, its "
                              f"{req.num_computed_tokens} computed tokens recomputed when it is scheduled "
                              "again",
                              subject=req.request_id)
        self.kv.free(req)
        req.collected_rows.clear()  # recomputed with the rest (prompt_logprobs already scored are kept)
        req.status = RequestStatus.WAITING
        preempted.append(req)
        self.add(req)
