"""OutputProcessor: a step's sampled tokens into its requests and out as RequestOutputs.

Per scheduled request, in order: append its tokens one by one (a stop inside a run cuts it there),
detokenize and cut stop strings, have the KV manager accept what was verified (a tree's kept path moved,
rejected drafts' blocks back, full blocks committed), mark it finished, emit its delta.
"""

from dataclasses import dataclass

from scheduling.kv_cache_manager import KVCacheManager
from scheduling.outputs import RequestOutput, SamplerOutput
from scheduling.plan import StepPlan
from scheduling.request import Request, RequestStatus
from scheduling.sampling.stop_checker import find_stop_string, finish_reason_after_token, num_safe_chars


@dataclass(frozen=True)
class ProcessedStep:
    outputs: list[RequestOutput]
    finished: list[Request]  # finished this step (Scheduler.update_from_output releases them)
    num_generated_tokens: int  # output tokens appended
    num_computed_tokens: int  # tokens whose KV the step kept
    num_forced_tokens: int = 0  # of the appended, those a grammar forced (jump-forward: not sampled)


class OutputProcessor:
    def __init__(self, kv: KVCacheManager, eos_token_ids: tuple[int, ...], jump_forward: bool = False):
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.jump_forward = jump_forward  # append what a grammar forces (scheduling/sampling/structured.py)

    def process(self, plan: StepPlan, out: SamplerOutput) -> ProcessedStep:
        outputs, finished = [], []
        num_generated = num_computed = num_forced = 0
        for scheduled, sampled, rows, scored in zip(plan.scheduled, out.sampled, out.collected,
                                                    out.prompt_logprobs):
            req = scheduled.request
            start, reason = req.num_computed_tokens, None
            if scored is not None:
                req.prompt_logprobs += scored
            if rows is not None:
                req.collected_rows.append(rows)
                reason = "length" if start + scheduled.num_new_tokens == req.num_tokens else None
            elif sampled is not None:
                num_appended, reason = self._append_tokens(req, sampled.token_ids, sampled.logprobs)
                if reason is None and self._jumps(req):
                    forced = req.matcher.forced_tokens(req.max_num_tokens - req.num_tokens)
                    num_jumped, reason = self._append_tokens(req, forced, None) if forced else (0, None)
                    num_appended += num_jumped
                    num_forced += num_jumped
                num_generated += num_appended
            num_accepted, kept_rows = (sampled.num_accepted_tokens, sampled.rows) if sampled else (0, [])
            self.kv.accept(scheduled, num_accepted, kept_rows)
            num_computed += req.num_computed_tokens - start
            if reason is not None:
                finish(req, reason)
                finished.append(req)
            if sampled is not None or reason is not None:
                outputs.append(emit(req))
        return ProcessedStep(outputs, finished, num_generated, num_computed, num_forced)

    def _jumps(self, req: Request) -> bool:
        """Whether req's grammar-forced tokens are appended (a request with logprobs samples every token)."""
        return self.jump_forward and req.matcher is not None and req.params.logprobs is None

    def _append_tokens(self, req: Request, token_ids: list[int],
                       logprobs: list[dict] | None) -> tuple[int, str | None]:
        """Append token by token; -> (tokens appended, the finish reason at the first token that ends the
        request (the rest of the run is dropped), else None)."""
        p = req.params
        for j, token in enumerate(token_ids):
            req.token_ids.append(token)
            if logprobs is not None:
                req.logprobs.append(logprobs[j])
            reason = finish_reason_after_token(token, req.num_tokens - req.num_prompt_tokens, req.num_tokens,
                                               req.max_num_tokens, p, self.eos_token_ids)
            if req.detokenizer is not None and reason != "stop":
                delta = req.detokenizer.add([token])
                req.text += delta
                # before min_tokens, stop strings end nothing (as stop tokens cannot be sampled)
                num_output = req.num_tokens - req.num_prompt_tokens
                cut = (find_stop_string(req.text, len(delta), p.stop) if p.stop and num_output > p.min_tokens
                       else -1)
                if cut >= 0:
                    req.text = req.text[:cut]
                    reason = "stop"
            if reason is None and req.matcher is not None and req.matcher.advance(token):
                reason = "stop"  # the constrained output is complete
            if reason is not None:
                return j + 1, reason
        return len(token_ids), None


def finish(req: Request, reason: str) -> None:
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason


def emit(req: Request) -> RequestOutput:
    """req's tokens and text since its last output (text held back while it may still become a stop
    string)."""
    safe = len(req.text) if req.finished else num_safe_chars(req.text, req.params.stop)
    text = req.text[req.num_emitted_chars:safe]
    req.num_emitted_chars = max(req.num_emitted_chars, safe)
    new_ids = req.output_token_ids[req.num_emitted_tokens:]
    prompt_logprobs = None  # once, with the first tokens
    if req.params.prompt_logprobs is not None and req.num_emitted_tokens == 0 and new_ids:
        prompt_logprobs = [None, *req.prompt_logprobs]
    req.num_emitted_tokens += len(new_ids)
    logprobs = req.logprobs[len(req.logprobs) - len(new_ids):] if req.params.logprobs is not None else None
    return RequestOutput(req.request_id, new_ids, text, req.finish_reason, logprobs, prompt_logprobs)
