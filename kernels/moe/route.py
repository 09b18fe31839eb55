"""Mixture-of-experts pieces: route tokens to their top-k experts, group a step's (token, slot) pairs by
expert, gather an expert's input rows, and sum each token's expert outputs (kept grouped by expert).

A (token t, slot j) pair is named by its flat position t * k + j, slot j holding the token's j-th largest
routing weight. Each token's result is computed from its own row alone and summed in slot order, so it does
not depend on the batch (batch invariance, models/linear.py).
"""

import math

import numpy as np
from numba import njit, prange

PARALLEL_MIN_TOKENS = 16  # waking the thread pool costs more than a few tokens' sums (kernels/norms.py)


@njit(cache=True, nogil=True)
def route_tokens(logits, normalize, ids, weights):
    # logits: [T, E] f32 -> ids: [T, k] int32, weights: [T, k] f32, the k largest softmax probabilities in
    # descending order, equal ones by ascending expert id; normalize: divide them by their sum
    T, E = logits.shape
    k = ids.shape[1]
    probs = np.empty(E, np.float32)
    for t in range(T):
        m = logits[t, 0]
        for e in range(1, E):
            m = max(m, logits[t, e])
        total = np.float32(0.0)
        for e in range(E):
            probs[e] = np.float32(math.exp(logits[t, e] - m))
            total += probs[e]
        for e in range(E):
            probs[e] = probs[e] / total
        num = 0  # insertion into the sorted top k; strict > keeps the lower id first among equals
        for e in range(E):
            p = probs[e]
            if num == k and not p > weights[t, k - 1]:
                continue
            j = min(num, k - 1)
            while j > 0 and p > weights[t, j - 1]:
                weights[t, j] = weights[t, j - 1]
                ids[t, j] = ids[t, j - 1]
                j -= 1
            weights[t, j] = p
            ids[t, j] = e
            num = min(num + 1, k)
        if normalize:
            total = np.float32(0.0)
            for j in range(k):
                total += weights[t, j]
            for j in range(k):
                weights[t, j] = weights[t, j] / total


@njit(cache=True, nogil=True)
def group_by_expert(ids, offsets, slots, position):
    # ids: [T, k] int32 in [0, E) -> offsets: [E + 1] int64, slots: [T * k] int64 flat positions t * k + j,
    # position: [T * k] int64 its inverse (slots[position[p]] = p); expert e's pairs are
    # slots[offsets[e]:offsets[e + 1]], ascending (so by token). A counting sort.
    T, k = ids.shape
    E = offsets.shape[0] - 1
    offsets[:] = 0
    for t in range(T):
        for j in range(k):
            e = ids[t, j]
            if e < 0 or e >= E:
                raise ValueError("expert id out of range")
            offsets[e + 1] += 1
    for e in range(E):
        offsets[e + 1] += offsets[e]
    for t in range(T):  # offsets[e] serves as expert e's cursor, then is shifted back
        for j in range(k):
            e = ids[t, j]
            slots[offsets[e]] = t * k + j
            position[t * k + j] = offsets[e]
            offsets[e] += 1
    for e in range(E, 0, -1):
        offsets[e] = offsets[e - 1]
    offsets[0] = 0


@njit(cache=True, nogil=True)
def active_experts(offsets, active, starts):
    # offsets: [E + 1] (group_by_expert) -> active[:S]: the experts with pairs, ascending, starts[:S + 1]:
    # active[s]'s pairs are slots[starts[s]:starts[s + 1]]; -> S
    S = 0
    for e in range(offsets.shape[0] - 1):
        if offsets[e + 1] > offsets[e]:
            active[S] = e
            starts[S] = offsets[e]
            S += 1
    starts[S] = offsets[-1]
    return S


@njit(cache=True, nogil=True)
def gather_rows(x, slots, k, out):
    # x: [T, H] f32, slots: [n] flat positions -> out: [n, H] f32, out[i] = x[slots[i] // k]
    for i in range(slots.shape[0]):
        out[i, :] = x[slots[i] // k, :]


@njit(cache=True, nogil=True)
def weighted_sum(y, weights, position, out):
    # y: [>= T * k, H] f32 each pair's expert output, grouped by expert (group_by_expert's order), weights:
    # [T, k] f32, position: [T * k] where pair t * k + j's row is -> out: [T, H] f32
    if out.shape[0] >= PARALLEL_MIN_TOKENS:
        _weighted_sum_parallel(y, weights, position, out)
    else:
        _weighted_sum_serial(y, weights, position, out)


# no fastmath: contracting into FMAs (or reassociating) could give the serial and parallel loops other bits
@njit(inline="always", nogil=True)
def _weighted_sum_row(y, weights, position, out, t):
    k = weights.shape[1]
    out[t, :] = 0.0
    for j in range(k):  # slot order: the same sum for a token in any batch
        w = weights[t, j]
        r = position[t * k + j]
        for h in range(out.shape[1]):
            out[t, h] += w * y[r, h]


@njit(cache=True, nogil=True, parallel=True)
def _weighted_sum_parallel(y, weights, position, out):
    for t in prange(out.shape[0]):
        _weighted_sum_row(y, weights, position, out, t)


@njit(cache=True, nogil=True)
def _weighted_sum_serial(y, weights, position, out):
    for t in range(out.shape[0]):
        _weighted_sum_row(y, weights, position, out, t)
