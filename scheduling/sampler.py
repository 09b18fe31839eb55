"""Sampling: one step's logits rows -> tokens, all rows at once.

`sample_batch` is what a step calls: penalties only on the rows that set them, one argmax over every
greedy row, one numba call (kernels/sampling.py) for the sampled rows (temperature, top-k, top-p, min-p).
Filters follow the usual serving semantics, written out one request at a time in `apply_penalties` and
`sampling_probs` below (the reference the batched code is tested against): top_k keeps the k most likely
tokens, top_p the smallest set whose probability reaches top_p, min_p the tokens with probability
>= min_p * the top probability.

Randomness is keyed, never counted: a request's draw for the token at position p is kernels/race.py's
exponential race with clocks keyed by (seed, p, token id), so a resumed request, a preempted one
recomputed, or a speculative verification redraws exactly what it would have, and a draft model racing
with the same clocks on its own logits guesses that draw (models/proposers/draft.py).
"""

import secrets
from collections.abc import Sequence

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from kernels.race import fill_row_keys
from kernels.sampling import log_normalizers, sample_filtered

# ---- keyed randomness --------------------------------------------------------------------------------

def request_seed(params: SamplingParams) -> int:
    """The seed a request's draws are keyed by: params.seed, else a random one. Draw it once, when the
    request is created, and store it on the request (`req.seed`)."""
    return (secrets.randbits(64) if params.seed is None else params.seed) % 2**64


def row_keys(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """[N] uint64: the key of the race for the token at positions[i] of a request seeded seeds[i]."""
    out = np.empty(len(seeds), np.uint64)
    fill_row_keys(np.asarray(seeds, np.uint64), np.asarray(positions, np.int64), out)
    return out


def _seed_of(req) -> int:
    seed = getattr(req, "seed", None)
    return request_seed(req.params) if seed is None else seed


# ---- the batched sampler -----------------------------------------------------------------------------

def sample_batch(logits: np.ndarray, requests: Sequence, positions: Sequence[int] | None = None) -> np.ndarray:
    """[N] int64: one token per row. logits: [N, V] float32, row i for requests[i] (anything with .params,
    .token_ids = prompt + output, .num_prompt_tokens, and .seed or a seeded params). positions[i]: where
    the token will sit, keying its draw (default len(token_ids))."""
    if not len(requests):
        return np.empty(0, np.int64)
    logits = apply_penalties_batch(np.asarray(logits, np.float32), requests)
    greedy = np.array([r.params.greedy for r in requests], bool)
    if greedy.all():
        return np.argmax(logits, axis=1).astype(np.int64)
    out = np.empty(len(requests), np.int64)
    if greedy.any():
        out[greedy] = np.argmax(logits[greedy], axis=1)
    rows = np.flatnonzero(~greedy)
    reqs = [requests[i] for i in rows]
    where = [len(r.token_ids) for r in reqs] if positions is None else np.asarray(positions)[rows]
    keys = row_keys([_seed_of(r) for r in reqs], where)
    tokens = np.empty(len(rows), np.int64)
    sample_filtered(np.ascontiguousarray(logits[rows] if len(rows) < len(requests) else logits),
                    *_filter_args(reqs), keys, tokens)
    out[rows] = tokens
    return out


def _filter_args(requests: Sequence) -> tuple[np.ndarray, ...]:
    params = [r.params for r in requests]
    return (np.array([p.temperature for p in params], np.float64), np.array([p.top_k for p in params], np.int64),
            np.array([p.top_p for p in params], np.float64), np.array([p.min_p for p in params], np.float64))


def apply_penalties_batch(logits: np.ndarray, requests: Sequence) -> np.ndarray:
    """logits [N, V] float32 with each row's penalties applied (the arithmetic of `apply_penalties`): a copy,
    or logits itself when no request sets a penalty."""
    params = [r.params for r in requests]
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    counted = [i for i, p in enumerate(params) if (p.presence_penalty or p.frequency_penalty)
               and len(requests[i].token_ids) > requests[i].num_prompt_tokens]
    if not repeat and not counted:
        return logits
    out = logits.copy()
    flat = out.reshape(-1)
    V = out.shape[1]
    if repeat:  # every distinct prompt or output token of the row
        seen = np.unique(np.concatenate([i * V + np.asarray(requests[i].token_ids, np.int64) for i in repeat]))
        penalty = np.array([p.repetition_penalty for p in params], np.float32)[seen // V]
        vals = flat[seen]
        flat[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    if counted:  # output tokens only, by count
        keys = np.concatenate([i * V + np.asarray(requests[i].token_ids[requests[i].num_prompt_tokens:], np.int64)
                               for i in counted])
        ids, counts = np.unique(keys, return_counts=True)
        row = ids // V
        frequency = np.array([p.frequency_penalty for p in params])[row]
        presence = np.array([p.presence_penalty for p in params])[row]
        flat[ids] = flat[ids] - (frequency * counts + presence)
    return out


def top_logprobs_batch(logits: np.ndarray, token_ids: Sequence[int], num_logprobs: Sequence[int]
                       ) -> list[dict[int, float]]:
    """Per row: the token's log-probability and the num_logprobs[i] most likely ones (descending), under the
    raw model distribution. logits: [N, V] float32."""
    logits = np.ascontiguousarray(logits, np.float32)
    norms = np.empty(logits.shape[0])
    log_normalizers(logits, norms)
    out = []
    for x, norm, token, k in zip(logits, norms, token_ids, num_logprobs):
        top = np.argpartition(-x, k)[:k] if 0 < k < x.shape[0] else np.arange(x.shape[0] if k else 0)
        top = top[np.argsort(-x[top], kind="stable")]
        row = {int(t): float(np.float64(x[t]) - norm) for t in top}
        row.setdefault(int(token), float(np.float64(x[token]) - norm))
        out.append(row)
    return out


# ---- the reference: one request at a time ----------------------------------------------------------------

def apply_penalties(logits: np.ndarray, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> np.ndarray:
    # logits: [V] f32, modified copy
    logits = logits.copy()
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy request samples from: [V] float64, sums to 1."""
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        drop = cumulative - probs[order] >= params.top_p  # tokens after the set already reached top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One request's token from a counted generator, as the engine sampled before sample_batch: the reference
    sample_batch is tested against (the same greedy tokens, the same distribution). The engine does not call it."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = sampling_probs(logits, params)
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))

