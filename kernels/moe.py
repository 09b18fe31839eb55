"""Mixture-of-experts pieces: route tokens to their top-k experts, group a step's (token, slot) pairs by
expert, gather an expert's input rows, scatter its output rows, and sum each token's expert outputs.

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
def group_by_expert(ids, offsets, slots):
    # ids: [T, k] int32 in [0, E) -> offsets: [E + 1] int64, slots: [T * k] int64 flat positions t * k + j;
    # expert e's pairs are slots[offsets[e]:offsets[e + 1]], ascending (so by token). A counting sort.
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
            offsets[e] += 1
    for e in range(E, 0, -1):
        offsets[e] = offsets[e - 1]
    offsets[0] = 0


@njit(cache=True, nogil=True)
def gather_rows(x, slots, k, out):
    # x: [T, H] f32, slots: [n] flat positions -> out: [n, H] f32, out[i] = x[slots[i] // k]
    for i in range(slots.shape[0]):
        out[i, :] = x[slots[i] // k, :]


@njit(cache=True, nogil=True)
def scatter_rows(src, slots, dst):
    # src: [n, H] f32, slots: [n] flat positions -> dst: [T * k, H] f32, dst[slots[i]] = src[i]
    for i in range(slots.shape[0]):
        dst[slots[i], :] = src[i, :]


def weighted_sum(y, weights, out):
    # y: [T, k, H] f32 (each slot's expert output), weights: [T, k] f32 -> out: [T, H] f32
    (_weighted_sum_parallel if out.shape[0] >= PARALLEL_MIN_TOKENS else _weighted_sum_serial)(y, weights, out)


# no fastmath: contracting into FMAs (or reassociating) could give the serial and parallel loops other bits
@njit(inline="always", nogil=True)
def _weighted_sum_row(y, weights, out, t):
    out[t, :] = 0.0
    for j in range(y.shape[1]):  # slot order: the same sum for a token in any batch
        w = weights[t, j]
        for h in range(y.shape[2]):
            out[t, h] += w * y[t, j, h]


@njit(cache=True, nogil=True, parallel=True)
def _weighted_sum_parallel(y, weights, out):
    for t in prange(out.shape[0]):
        _weighted_sum_row(y, weights, out, t)


@njit(cache=True, nogil=True)
def _weighted_sum_serial(y, weights, out):
    for t in range(out.shape[0]):
        _weighted_sum_row(y, weights, out, t)
