"""LLM: one engine in this process, no Ray, safe to call from many threads."""

import itertools
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Self

import numpy as np

from cluster_configs.engine_config import EngineConfig
from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from numaserve.session import Session
from scheduling.embedding import POOLINGS, embed
from scheduling.engine import Engine
from scheduling.engine_loop import EngineLoop, texts
from scheduling.outputs import Completion
from scheduling.sampling.best_of import best, candidate_params

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
    """One engine in this process, shared by every thread that calls it: their requests batch together in
    the steps of one loop thread (scheduling/engine_loop.py). close(), or leaving a `with` block, stops that
    thread; later calls raise EngineClosed."""

    def __init__(self, model: str | Path, **engine_config_fields):
        self.config = EngineConfig(**engine_config_fields)
        self.engine = Engine(model, self.config)
        self._loop = EngineLoop(self.engine)
        weakref.finalize(self, self._loop.close)  # an LLM dropped unclosed ends its thread too

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the engine's thread; requests still pending fail with EngineClosed. Idempotent."""
        self._loop.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def engine_loop(self) -> EngineLoop:
        """The thread that runs the engine: other front ends (the tests' HTTP deployment) submit to it."""
        return self._loop

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None,
                 adapter: str | Sequence[str | None] | None = None,
                 cache_salt: str | None = None) -> list[Completion]:
        """params and adapter: one for every prompt, or a list with one per prompt (adapter None: the base
        model). cache_salt: share cached prefix blocks only with requests of the same salt. A prompt whose
        params set best_of gets the best of that many candidates (scheduling/sampling/best_of.py)."""
        prompts = _as_prompt_list(prompts)
        params_list = _per_prompt(params, len(prompts), "params", "a numaserve.SamplingParams",
                                  (SamplingParams, type(None)))
        adapters = _per_prompt(adapter, len(prompts), "adapter", "an adapter name (str) or None",
                               (str, type(None)))
        # every prompt validated before any work; a best_of prompt's candidates are its consecutive requests
        requests, num_candidates = [], []
        for p, sp, a in zip(prompts, params_list, adapters):
            candidates = [sp] if sp is None or sp.best_of is None else candidate_params(sp, sp.best_of)
            requests += [self.engine.make_request(f"llm-{next(_ids)}", p, c, adapter=a, cache_salt=cache_salt)
                         for c in candidates]
            num_candidates.append(len(candidates))
        done = iter(self._loop.run(requests))
        completions = []
        for sp, k in zip(params_list, num_candidates):
            candidates = [next(done) for _ in range(k)]
            if k == 1 and (sp is None or sp.best_of is None):
                completions.append(Completion.from_request(candidates[0]))
                continue
            [i] = best(1, [(r.output_token_ids, r.logprobs) for r in candidates])
            completion = Completion.from_request(candidates[i])
            if sp.logprobs is None:
                completion.logprobs = None  # asked only to rank the candidates
            completions.append(completion)
        return completions

    def stream(self, prompt, params: SamplingParams | None = None, adapter: str | None = None,
               cache_salt: str | None = None) -> Iterator[str]:
        """Text deltas of one completion as they are decoded; closing the iterator (or dropping it) aborts the
        request."""
        req = self.engine.make_request(f"llm-{next(_ids)}", prompt, params, adapter=adapter,
                                       cache_salt=cache_salt)
        yield from texts(self._loop.stream(req))

    def session(self, adapter: str | None = None, cache_salt: str | None = None) -> Session:
        """A session: sequences that keep their KV between turns (numaserve/session.py)."""
        return Session(self._loop, self.engine, adapter, cache_salt)

    def score(self, token_ids, adapter: str | None = None) -> np.ndarray:
        """Next-token logits at every position: float32 [len(token_ids), vocab]."""
        req = self.engine.make_request(f"llm-score-{next(_ids)}", token_ids, SamplingParams(max_tokens=1),
                                       adapter=adapter, prompt_logits=True)
        [req] = self._loop.run([req])
        return np.concatenate(req.collected_rows)

    def embed(self, prompts, pooling: str = "last", normalize: bool = True,
              adapter: str | None = None) -> np.ndarray:
        """float32 [num_prompts, hidden]: each prompt's final hidden states (after the final norm, what the LM
        head reads) pooled over its tokens, "last" (the last token's) or "mean"; L2-normalized if normalize.
        The prompts batch together in the engine's steps, like generate's."""
        if pooling not in POOLINGS:
            raise InvalidRequest(f"pooling must be one of {POOLINGS}, got {pooling!r}", param="pooling")
        return embed(self._loop, self.engine, _as_prompt_list(prompts), pooling, normalize, adapter)

    def register_adapter(self, name: str, path: str | Path) -> None:
        """Serve a PEFT LoRA adapter directory as `adapter=name`; other weights under a served name are its
        new version (requests started before keep the old weights)."""
        self._loop.call(lambda engine: engine.register_adapter(name, path))

    def unload_adapter(self, name: str) -> None:
        """Serve the adapter no more: requests that use it finish on its weights; registered again, it is a
        new version. AdapterError if no adapter has that name."""
        self._loop.call(lambda engine: engine.unload_adapter(name))

    def compose_adapter(self, name: str, weights: dict[str, float], combination: str = "svd") -> None:
        """Serve as `adapter=name` the weighted combination of registered adapters, as PEFT's
        add_weighted_adapter builds it: combination "cat", "linear" or "svd"."""
        self._loop.call(lambda engine: engine.compose_adapter(name, weights, combination))

    def stats(self) -> dict:
        return self._loop.call(Engine.stats)

    def diagnostics(self) -> list[dict]:
        """The engine's recent decisions and why: kernel paths and fallbacks, threading, speculation, ..."""
        return self._loop.call(lambda engine: engine.decisions.recent())


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
