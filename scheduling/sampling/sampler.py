"""Sampling: one step's logits rows -> tokens, all rows at once.

`sample_batch` is what a step calls, over the step's SamplingBatch (models/sampling_batch.py): the sparse
additions (logit_bias, min_tokens' bans on stop tokens) and penalties only on the rows that set them, token
masks where a row has one, one argmax over every greedy row, one numba call (kernels/sampling/filters.py) for
the sampled rows (temperature, top-k, top-p, min-p). Filters follow the usual serving semantics, written out
one request at a time in tests/support/reference_sampler.py (the reference the batched code is tested
against): top_k keeps the k most likely tokens, top_p the smallest set whose probability reaches top_p, min_p
the tokens with probability >= min_p * the top probability.

Randomness is keyed, never counted: a request's draw for the token at position p is kernels/sampling/race.py's
exponential race with clocks keyed by (seed, p, token id), so a resumed request, a preempted one
recomputed, or a speculative verification redraws exactly what it would have, and a draft model racing
with the same clocks on its own logits guesses that draw (models/proposers/draft.py).
"""

import secrets
from collections.abc import Sequence

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from kernels.sampling.filters import log_normalizers, sample_filtered
from kernels.sampling.race import fill_row_keys
from models.sampling_batch import SamplingBatch

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


# ---- the batched sampler -----------------------------------------------------------------------------

def sample_batch(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """[N] int64: one token per row. logits: [N, V] float32, row i sampled as batch's row i."""
    if not batch.num_rows:
        return np.empty(0, np.int64)
    logits = apply_penalties_batch(add_to_logits(np.asarray(logits, np.float32), batch), batch)
    if batch.token_masks is not None:
        logits = np.where(batch.token_masks, logits, np.float32(-np.inf))
    greedy = batch.greedy
    if greedy.all():
        return np.argmax(logits, axis=1).astype(np.int64)
    out = np.empty(batch.num_rows, np.int64)
    if greedy.any():
        out[greedy] = np.argmax(logits[greedy], axis=1)
    rows = np.flatnonzero(~greedy)
    keys = row_keys(batch.seeds[rows], batch.positions[rows])
    tokens = np.empty(len(rows), np.int64)
    sample_filtered(np.ascontiguousarray(logits[rows] if len(rows) < batch.num_rows else logits),
                    batch.temperatures[rows], batch.top_k[rows], batch.top_p[rows], batch.min_p[rows],
                    keys, tokens)
    out[rows] = tokens
    return out


def add_to_logits(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """logits [N, V] float32 plus the batch's sparse additions (logit_bias, min_tokens' bans): a copy, or
    logits itself when no row has one."""
    if batch.logit_adds is None:
        return logits
    rows, ids, values = batch.logit_adds
    out = logits.copy()
    np.add.at(out, (rows, ids), values)  # a row's bias and ban may name one token
    return out


def apply_penalties_batch(logits: np.ndarray, batch: SamplingBatch) -> np.ndarray:
    """logits [N, V] float32 with each row's penalties applied (tests/support/reference_sampler.py's
    apply_penalties, row by row): a copy, or logits itself when no row sets a penalty."""
    repeat = np.flatnonzero(batch.repetition_penalties != 1.0)
    counted = [i for i in np.flatnonzero((batch.presence_penalties != 0) | (batch.frequency_penalties != 0))
               if len(batch.histories[i]) > batch.num_prompt_tokens[i]]
    if not len(repeat) and not counted:
        return logits
    out = logits.copy()
    flat = out.reshape(-1)
    V = out.shape[1]
    if len(repeat):  # every distinct prompt or output token of the row
        seen = np.unique(np.concatenate([i * V + np.asarray(batch.histories[i], np.int64) for i in repeat]))
        penalty = batch.repetition_penalties[seen // V]
        vals = flat[seen]
        flat[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    if counted:  # output tokens only, by count
        keys = np.concatenate([i * V + np.asarray(batch.histories[i][batch.num_prompt_tokens[i]:], np.int64)
                               for i in counted])
        ids, counts = np.unique(keys, return_counts=True)
        row = ids // V
        flat[ids] = flat[ids] - (batch.frequency_penalties[row] * counts + batch.presence_penalties[row])
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
