"""The engine: one model, one KV cache, one batcher. Each step plans, runs the model, post-processes."""

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numba

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from kernels import threading_decision
from memory.block_pool import BlockPool
from memory.heap import release_free_heap
from memory.kv_cache import KVCache, kv_bytes_per_token
from models.activation_plan import plan_activations
from models.calibration import load_calibration
from models.llama import LlamaModel
from models.loader import load_model
from models.lora import LoraAdapter
from models.lora_slots import LoraSlots, slot_dtype
from models.tokenizer import IncrementalDetokenizer
from scheduling.adapter_store import AdapterStore
from scheduling.batcher import Batcher, StepPlan
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.lora_planner import LoraPlanner, SharedMerged
from scheduling.method_chooser import make_speculator
from scheduling.model_runner import ModelRunner, RunOutput
from scheduling.outputs import RequestOutput, StepResult
from scheduling.request import Request, RequestStatus
from scheduling.speculator import spec_stats_off
from scheduling.step_sampler import sample_step
from scheduling.stop_checker import find_stop_string, finish_reason_after_token, num_safe_chars
from scheduling.validation import RequestLimits, validate_request

Prompt = str | list[int]


class Engine:
    def __init__(self, model_path: str | Path, config: EngineConfig | None = None,
                 fetch_adapter: Callable[[str], LoraAdapter] | None = None, shared_merged: SharedMerged | None = None):
        """fetch_adapter: where a worker gets the adapters registered elsewhere (AdapterStore.add_remote); it
        then holds at most max_loras of them. shared_merged: where merged LoRA copies are shared with the
        other workers of a deployment."""
        self.config = config = config or EngineConfig()
        self.decisions = DecisionLog()
        numba.set_num_threads(min(config.num_threads or len(os.sched_getaffinity(0)),
                                  numba.config.NUMBA_NUM_THREADS))
        self.decisions.record("threading", **threading_decision())  # after set_num_threads started the threads
        self.spec, weights, self.tokenizer = load_model(model_path, config.weight_dtype)
        weights = plan_activations(weights, config.activation_dtype, self.decisions, load_calibration(model_path))
        release_free_heap()  # the matrices plan_activations repacked
        self.model = LlamaModel(self.spec, weights)
        s, bs = self.spec, config.block_size
        self.max_model_len = config.max_model_len or s.max_position_embeddings
        block_bytes = kv_bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, config.resolved_kv_dtype) * bs
        num_blocks = min(config.kv_cache_bytes // block_bytes, config.max_num_seqs * -(-self.max_model_len // bs))
        if num_blocks < 1:
            raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} cannot hold one KV block of {block_bytes} "
                             "bytes; raise kv_cache_bytes or lower block_size")
        self.kv_cache = KVCache(s.num_layers, num_blocks, bs, s.num_kv_heads, s.head_dim, config.resolved_kv_dtype)
        window = min(s.layer_windows)  # blocks can be released only if every layer looks back a window
        self.kv = KVCacheManager(BlockPool(num_blocks), bs, config.enable_prefix_caching, window)
        self.batcher = Batcher(config, self.kv, self.decisions)
        self.requests: dict[str, Request] = {}
        self.adapters = AdapterStore(s, config.max_lora_rank, config.adapter_roots, fetch=fetch_adapter,
                                     max_loaded=config.max_loras if fetch_adapter else None)
        slots = LoraSlots(s, config.max_loras, config.max_lora_rank, slot_dtype(self.model.weight_dtype, s))
        self.runner = ModelRunner(self.model, self.kv_cache, bs, self.adapters, LoraPlanner(
            slots, self.model.weights.layers, s, config.lora_merge, config.lora_merged_bytes,
            self.model.weight_bytes, shared_merged, self.decisions))
        self.speculator = make_speculator(config, s, self.tokenizer, _model_dir(model_path), self.model,
                                          kv_cache_tokens=num_blocks * bs, decisions=self.decisions)
        self.runner.wants_hidden = self.speculator is not None and self.speculator.needs_hidden
        # what make_request validates against (the KV pool fit only when every layer keeps all its KV)
        self.limits = RequestLimits(s.vocab_size, self.max_model_len, block_size=bs,
                                    num_kv_blocks=num_blocks if window <= 0 else None)
        self.num_generated_tokens = 0

    def register_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT LoRA adapter; requests name it with adapter=name. Raises AdapterError."""
        self.adapters.register(name, path)

    def compose_adapter(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Register name as a weighted combination of registered adapters. Raises AdapterError."""
        self.adapters.compose(name, weights, combination)

    # ---- requests ---------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                    priority: int = 0, adapter: str | None = None, cache_salt: str | None = None,
                    prompt_logits: bool = False) -> Request:
        req = self.make_request(request_id, prompt, params, priority=priority, adapter=adapter,
                                cache_salt=cache_salt, prompt_logits=prompt_logits)
        self.submit(req)
        return req

    def make_request(self, request_id: str, prompt: Prompt, params: SamplingParams | None = None, *,
                     priority: int = 0, adapter: str | None = None, cache_salt: str | None = None,
                     prompt_logits: bool = False) -> Request:
        """A validated request, not yet queued: every InvalidRequest is raised here, before any work."""
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already running; use a unique id")
        prompt_ids, params = validate_request(prompt, params, self.limits, tokenizer=self.tokenizer, adapter=adapter,
                                              adapters=self.adapters, prompt_logits=prompt_logits)
        req = Request(request_id, prompt_ids, params, priority=priority, adapter_id=adapter, cache_salt=cache_salt,
                      prompt_logits=prompt_logits, max_model_len=self.max_model_len)
        if self.tokenizer is not None and not prompt_logits:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        return req

    def submit(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.batcher.add(req)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, "abort")
        return self._emit(req)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- the step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        expired = self.abort_expired()
        plan = self.batcher.schedule()
        for req in plan.preempted:
            self._forget_drafts(req.request_id)
        if not plan.scheduled:
            return expired
        draft_s = self.speculator.propose(plan, self.batcher) if self.speculator else 0.0
        run = self.runner.run(plan)
        result = sample_step(plan, run.logits, run.logit_rows)
        outputs = expired + self._process(plan, result)
        if run.hidden is not None:
            self._hand_over_hidden(plan, result, run)
        if self.speculator:  # the whole step but the proposer's passes: drafts also cost scheduling and rollback
            self.speculator.observe(plan, result, time.perf_counter() - start - draft_s, draft_s,
                                    len(self.batcher.waiting), self.kv.pool.num_used_blocks / self.kv.pool.num_blocks)
        return outputs

    def abort_expired(self) -> list[RequestOutput]:
        """Requests past their deadline (waiting or running) finish with "abort"; their blocks go back."""
        now = time.monotonic()
        expired = [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]
        return [out for r in expired if (out := self.abort(r.request_id)) is not None]

    def _process(self, plan: StepPlan, result: StepResult) -> list[RequestOutput]:
        """Append each request's tokens (a stop inside a run cuts it there), move its KV to what was
        verified (rejected drafts' slots roll back), commit full blocks, finish, emit."""
        index = {rid: i for i, rid in enumerate(result.req_ids)}
        outputs = []
        for req, n in plan.scheduled:
            start, rid = req.num_computed_tokens, req.request_id
            num_drafts = len(plan.draft_token_ids.get(rid, ()))
            i = index.get(rid)
            reason = None
            if req.prompt_logits:
                req.collected_logits.append(result.prompt_logits[rid])
                reason = "length" if start + n == req.num_tokens else None
            elif i is not None:
                reason = self._append_tokens(req, result.sampled_token_ids[i], result.logprobs[i])
            num_accepted = result.num_accepted_tokens[i] if i is not None else 0
            if num_accepted and rid in plan.draft_trees:  # the accepted path's KV to the slots after the root
                first = start + n - num_drafts
                nodes = [r - 1 for r in result.sampled_rows[i][1:]]
                self.kv_cache.move_slots(req.block_ids, [first + v for v in nodes], list(range(first, first + len(nodes))))
            req.num_computed_tokens = min(start + n - num_drafts + num_accepted, req.num_tokens)
            if num_drafts:
                self.kv.rollback(req)
            self.kv.commit_full_blocks(req)
            if reason is not None:
                self._finish(req, reason)
            if i is not None or reason is not None:
                outputs.append(self._emit(req))
        return outputs

    def _hand_over_hidden(self, plan: StepPlan, result: StepResult, run: RunOutput) -> None:
        """To a proposer that drafts from the target's features: each running request's features f_p of the
        positions this step verified (its prompt or verified rows, then a verification's kept path, whose
        last row produced its last token)."""
        index = {rid: i for i, rid in enumerate(result.req_ids)}
        for s, (req, n) in enumerate(plan.scheduled):
            rid = req.request_id
            if rid not in self.requests or req.prompt_logits:
                continue
            num_base = n - len(plan.draft_token_ids.get(rid, ()))
            rows = list(range(run.first_rows[s], run.first_rows[s] + num_base))  # positions first_positions[s] ...
            i = index.get(rid)
            if i is not None:  # the kept path's rows after the root (the request's last base row)
                rows += [rows[-1] + r for r in result.sampled_rows[i][1:]]
            self.speculator.observe_hidden(rid, run.first_positions[s], run.hidden[rows])

    def _append_tokens(self, req: Request, token_ids: list[int], logprobs: list[dict] | None) -> str | None:
        """Append token by token; -> the finish reason at the first token that ends the request (the rest
        of the run is dropped), else None."""
        p = req.params
        for j, token in enumerate(token_ids):
            req.token_ids.append(token)
            self.num_generated_tokens += 1
            if logprobs is not None:
                req.logprobs.append(logprobs[j])
            reason = finish_reason_after_token(token, req.num_tokens - req.num_prompt_tokens, req.num_tokens,
                                               req.max_num_tokens, p, self.spec.eos_token_ids)
            if req.detokenizer is not None and reason != "stop":
                delta = req.detokenizer.add([token])
                req.text += delta
                cut = find_stop_string(req.text, len(delta), p.stop) if p.stop else -1
                if cut >= 0:
                    req.text = req.text[:cut]
                    reason = "stop"
            if reason is not None:
                return reason
        return None

    def _finish(self, req: Request, reason: str) -> None:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.batcher.remove(req)
        self._forget_drafts(req.request_id)
        del self.requests[req.request_id]

    def _forget_drafts(self, request_id: str) -> None:
        if self.speculator:
            self.speculator.free(request_id)

    def _emit(self, req: Request) -> RequestOutput:
        safe = len(req.text) if req.finished else num_safe_chars(req.text, req.params.stop)
        text = req.text[req.num_emitted_chars:safe]
        req.num_emitted_chars = max(req.num_emitted_chars, safe)
        new_ids = req.output_token_ids[req.num_emitted_tokens:]
        req.num_emitted_tokens += len(new_ids)
        logprobs = req.logprobs[len(req.logprobs) - len(new_ids):] if req.params.logprobs is not None else None
        return RequestOutput(req.request_id, new_ids, text, req.finish_reason, logprobs)

    # ---- figures ----------------------------------------------------------------------------------

    def stats(self) -> dict:
        pool = self.kv.pool
        used_slots = pool.num_used_blocks * self.config.block_size
        stored = sum(r.num_computed_tokens for r in self.batcher.running)
        return {
            "num_running": len(self.batcher.running),
            "num_waiting": len(self.batcher.waiting),
            "num_blocks": pool.num_blocks,
            "num_free_blocks": pool.num_free_blocks,
            "kv_usage": pool.num_used_blocks / pool.num_blocks,
            "kv_utilization": stored / used_slots if used_slots else math.nan,
            "kv_bytes_per_token": self.kv_cache.bytes_per_token,
            "prefix_hit_rate": self.kv.prefix_hit_rate,
            "num_preemptions": self.batcher.num_preemptions,
            "num_generated_tokens": self.num_generated_tokens,
        } | self.adapters.stats() | self.runner.lora.stats() | (self.speculator.stats() if self.speculator else spec_stats_off())


def _model_dir(model_path: str | Path) -> Path:
    """The directory a model's side files (Medusa heads) sit in: the model directory, or a GGUF file's."""
    path = Path(model_path)
    return path.parent if path.suffix == ".gguf" else path
