"""What the speculation benchmarks share: engines that share one copy of the weights, a proposer swapped
into an engine, a recording proposer that measures acceptance per position, and a timed decode run."""

import itertools
import time
from collections.abc import Sequence

import numpy as np

import numaserve as ns
import scheduling.engine as engine_module
from models.proposers.base import Proposer, SpecRequest

_ids = itertools.count()
_weights: dict = {}


def share_weights() -> None:
    """Engines built after this share the loaded (and activation-planned) weights of the same checkpoint and
    weight and activation dtypes, so a benchmark can hold one engine per configuration without one copy per
    engine (the packed cache would read a copy for each). Planning's decisions go to the first engine's
    log."""
    if getattr(engine_module.load_planned, "_shared", False):
        return
    load = engine_module.load_planned

    def load_planned(path, config, decisions):
        key = (str(path), config.weight_dtype, config.activation_dtype)
        if key not in _weights:
            _weights[key] = load(path, config, decisions)
        return _weights[key]

    load_planned._shared = True
    engine_module.load_planned = load_planned


def forget_shared_weights() -> None:
    _weights.clear()


def find_proposer(engine) -> tuple[object, str] | None:
    """(owner, attribute) of the engine's proposer: the engine or one object it holds."""
    for owner in (engine, *vars(engine).values()):
        for name, value in list(getattr(owner, "__dict__", {}).items()):
            if isinstance(value, Proposer):
                return owner, name
    return None


def install_proposer(engine, proposer: Proposer) -> Proposer:
    """Replace the engine's proposer (built from its SpeculationConfig); -> the one it had."""
    found = find_proposer(engine)
    if found is None:
        raise RuntimeError("the engine holds no Proposer: build it with speculation={'method': 'ngram', ...}")
    owner, name = found
    old = getattr(owner, name)
    setattr(owner, name, proposer)
    return old


class RecordingProposer(Proposer):
    """Wraps a proposer and logs every draft, so acceptance per position can be read off the outputs."""

    def __init__(self, inner: Proposer):
        super().__init__()
        self.inner = inner
        self.cost_prior, self.catches_up = inner.cost_prior, inner.catches_up
        self.log: list[tuple[str, int, list[int]]] = []  # (request id, tokens it had, drafts)

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        drafts = self.inner.propose(requests, depths)
        self.last_passes = self.inner.last_passes  # the policy prices the proposer per pass
        for req, d in zip(requests, drafts):
            if d:
                self.log.append((req.request_id, len(req.token_ids), list(d)))
        return drafts

    def free(self, request_id: str) -> None:
        self.inner.free(request_id)

    def acceptance(self, final_tokens: dict[str, list[int]], max_depth: int) -> dict:
        """Per position: drafts verified there (every earlier one accepted) and accepted, from the final
        token ids of each request (a draft is accepted iff the token appended at its place equals it)."""
        verified, accepted = np.zeros(max_depth, np.int64), np.zeros(max_depth, np.int64)
        num_drafted = 0
        for rid, num_tokens, drafts in self.log:
            final = final_tokens.get(rid)
            if final is None:
                continue
            num_drafted += len(drafts)
            for i, d in enumerate(drafts[:max_depth]):
                if num_tokens + i >= len(final):
                    break  # the request ended before this draft's place: never verified
                verified[i] += 1
                if final[num_tokens + i] != d:
                    break
                accepted[i] += 1
        self.log.clear()
        return {"verified_per_position": verified.tolist(), "accepted_per_position": accepted.tolist(),
                "accept_rate_per_position": [float(a / v) if v else None for a, v in zip(accepted, verified)],
                "num_draft_tokens": num_drafted,
                "accepted_per_draft_token": float(accepted.sum() / max(1, num_drafted)),
                "num_verifications": int(verified[0])}


def run_decode(engine, prompts: list, params: ns.SamplingParams, num_steps: int | None = None) -> dict:
    """Submit `prompts` together, run their prefill untimed, then time decode steps until they finish (or
    `num_steps` steps, after which they are aborted). -> decode tokens, seconds, steps, final token ids."""
    reqs = [engine.add_request(f"bench-{next(_ids)}", p, params) for p in prompts]
    while engine.has_unfinished() and any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    num_tokens, steps = 0, 0
    start = time.perf_counter()
    while engine.has_unfinished() and (num_steps is None or steps < num_steps):
        num_tokens += sum(len(o.token_ids) for o in engine.step().outputs)
        steps += 1
    seconds = time.perf_counter() - start
    final = {r.request_id: list(r.token_ids) for r in reqs}
    for r in reqs:
        if not r.finished:
            engine.abort(r.request_id)
    return {"tokens": num_tokens, "seconds": seconds, "steps": steps, "final": final,
            "outputs": [r.output_token_ids for r in reqs]}


def spec_stats(engine) -> dict:
    """The engine's own speculation figures (stats() keys spec_*), when it reports them."""
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_")}
