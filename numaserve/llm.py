"""LLM: one engine in this process, no Ray."""

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from scheduling.engine import Engine
from scheduling.outputs import Completion
from scheduling.request import Request

_ids = itertools.count()


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, np.ndarray):
        prompts = prompts.tolist()
    if isinstance(prompts, Sequence) and prompts and all(isinstance(p, (int, np.integer)) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, Sequence) and prompts:
        return list(prompts)
    raise InvalidRequest("prompts must be a str, a list of str, a list of token ids, or a list of those; got "
                         f"{prompts!r:.60}")


class LLM:
    def __init__(self, model: str | Path, **engine_config_fields):
        self.config = EngineConfig(**engine_config_fields)
        self.engine = Engine(model, self.config)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | Sequence[str | None] | None = None) -> list[Completion]:
        """params and adapter: one for every prompt, or a list with one per prompt (adapter None: the base
        model)."""
        prompts = _as_prompt_list(prompts)
        params_list = _per_prompt(params, len(prompts), "params", "a numaserve.SamplingParams",
                                  (SamplingParams, type(None)))
        adapters = _per_prompt(adapter, len(prompts), "adapter", "an adapter name (str) or None",
                               (str, type(None)))
        # every prompt validated before any work
        requests = [self.engine.make_request(f"llm-{next(_ids)}", p, sp, adapter=a)
                    for p, sp, a in zip(prompts, params_list, adapters)]
        for req in requests:
            self.engine.submit(req)
        self._run_until_done(requests)
        return [self._completion(req) for req in requests]

    def stream(self, prompt, params: SamplingParams | None = None,
               adapter: str | None = None) -> Iterator[str]:
        """Text deltas of one completion as they are decoded; closing the iterator aborts the request."""
        req = self.engine.add_request(f"llm-{next(_ids)}", prompt, params, adapter=adapter)
        try:
            while not req.finished:
                for out in self.engine.step().outputs:
                    if out.request_id == req.request_id and out.text:
                        yield out.text
        finally:
            if not req.finished:
                self.engine.abort(req.request_id)

    def score(self, token_ids, adapter: str | None = None) -> np.ndarray:
        """Next-token logits at every position: float32 [len(token_ids), vocab]."""
        req = self.engine.add_request(f"llm-score-{next(_ids)}", token_ids, SamplingParams(max_tokens=1),
                                      adapter=adapter, prompt_logits=True)
        self._run_until_done([req])
        return np.concatenate(req.collected_logits)

    def register_adapter(self, name: str, path: str | Path) -> None:
        """Serve a PEFT LoRA adapter directory as `adapter=name`."""
        self.engine.register_adapter(name, path)

    def compose_adapter(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Serve as `adapter=name` the weighted combination of registered adapters, as PEFT's
        add_weighted_adapter builds it: combination "cat", "linear" or "svd"."""
        self.engine.compose_adapter(name, weights, combination)

    def stats(self) -> dict:
        return self.engine.stats()

    def diagnostics(self) -> list[dict]:
        """The engine's recent decisions and why: kernel paths and fallbacks, threading, speculation, ..."""
        return self.engine.decisions.recent()

    def _run_until_done(self, requests: list[Request]) -> None:
        try:
            while not all(r.finished for r in requests):
                self.engine.step()
        except BaseException:
            for r in requests:
                self.engine.abort(r.request_id)
            raise

    @staticmethod
    def _completion(req: Request) -> Completion:
        return Completion(prompt_token_ids=req.token_ids[:req.num_prompt_tokens],
                          token_ids=req.output_token_ids,
                          text=req.text, finish_reason=req.finish_reason,
                          logprobs=req.logprobs if req.params.logprobs is not None else None)


def _per_prompt(value, num_prompts: int, name: str, expected: str, single: tuple[type, ...]) -> list:
    """One value for every prompt, or a list (tuple) of one per prompt."""
    if isinstance(value, single):
        return [value] * num_prompts
    if not isinstance(value, list | tuple):
        raise InvalidRequest(f"{name} must be {expected} or a list of one per prompt, got "
                             f"{type(value).__name__}")
    if len(value) != num_prompts:
        raise InvalidRequest(f"{len(value)} {name} for {num_prompts} prompts; pass one per prompt")
    return list(value)
