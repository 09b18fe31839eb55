"""One token's attention in chunks of its visible slots (kernels/attention/paged.py's rule): each chunk's
partial softmax (largest score, sum of exponentials, unnormalized value sum), then the chunks merged in order
by the log-sum-exp rule; and the widening of a cached KV row to float32. Shared by the per-token kernels
(kernels/attention/paged.py) and the tiled prefill kernel (kernels/attention/tiles.py), so both give a token
the same bits.

The recent window (RecentWindow), with group > 0: a token at position p reads its sequence's context slots
from wide_start on, that is from recent_start(p, group) = (p // group - 1) * group (its group of positions and
the one before) but not before wide_from[seq] (the first slot its sequence computed since it got its blocks: a
prefix hit's slots have no wide copy), and every tree slot, from the bfloat16 shadow of their block
(k_wide[shadow_of[block]]) instead of the block's codes. group 0: no window."""

from collections import namedtuple

import numpy as np
from numba import njit, types
from numba.extending import overload

from kernels.attention.gauss4 import GAUSS4, GAUSS4_LEVELS
from kernels.attention.score_noise import debias, row_kappa, score_bias
from kernels.exp32 import exp32, tanh32
from kernels.formats.bf16 import as_f32
from kernels.formats.fp8 import fp8_as_f32, fp8_placement, fp8_row_factor, fp8_unbias
from kernels.simd.axpy import weighted_sum
from kernels.simd.dot import dots

NEG_BIG = np.float32(-3.0e38)  # stands in for -inf (fastmath assumes no infinities)
# fastmath without "reassoc": every sum in the order written (the scores' dot products in
# kernels/simd/dot.py), so the serial and the parallel kernel give a token the same bits (with "reassoc" they
# did not). "arcp" stays (the reciprocal once per row: no order to keep), and "afn" (per element); the
# softmax's exp is kernels/exp32.py's arithmetic, which vectorizes
FASTMATH = {"contract", "nnan", "ninf", "nsz", "afn", "arcp"}
VALUE_ROWS = 32  # value rows widened at a time by the per-token kernel: 8 KB of float32 at head_dim 64

# k_wide, v_wide: [num_shadows, block_size, n_kv, D] uint16 bfloat16 bits; shadow_of: [num_blocks] int32, a
# block's shadow (-1: none); wide_from: [S] int32; group: positions per group (0: no window)
RecentWindow = namedtuple("RecentWindow", ("k_wide", "v_wide", "shadow_of", "wide_from", "group"))
_NO_SHADOW = np.zeros((1, 1, 1, 1), np.uint16)
NO_WINDOW = RecentWindow(_NO_SHADOW, _NO_SHADOW, np.zeros(1, np.int32), np.zeros(1, np.int32), 0)


@njit(inline="always", nogil=True)
def visible(positions, tree_starts, tree_mask, window, t):
    # token t's visible slots in this order: context [start, end), then the num_tree tree slots its mask marks
    tree_start = tree_starts[t]
    end = positions[t] + 1 if tree_start < 0 else tree_start
    start = min(max(0, positions[t] + 1 - window) if window > 0 else 0, end)
    num_tree = 0
    if tree_start >= 0:
        for i in range(tree_mask.shape[1]):
            num_tree += tree_mask[t, i] != 0
    return start, end, num_tree


@njit(inline="always", nogil=True)
def recent_start(position, group):
    # the first position a token at position read from the recent window (group > 0)
    return max(0, (position // group - 1) * group)


@njit(inline="always", nogil=True)
def wide_start(recent, position, seq):
    # the first context slot a token at position of sequence row seq reads wide (past every slot: no window)
    group = recent.group
    if group <= 0:
        return np.int64(1 << 62)
    return np.int64(max(recent_start(position, group), recent.wide_from[seq]))


@njit(inline="always", nogil=True)
def num_chunks(num_visible, chunk):
    return max(1, (num_visible + chunk - 1) // chunk)


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
           positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk, out, t, kh):
    # token t, kv head kh, its whole group of query heads: the chunks' partial softmaxes one after another,
    # then merged (each key and value row read and widened once)
    group = q.shape[1] // k_cache.shape[2]
    start, end, num_tree = visible(positions, tree_starts, tree_mask, window, t)
    k = num_chunks(end - start + num_tree, chunk)
    m, l = np.empty((k, group), np.float32), np.empty((k, group), np.float32)
    acc = np.empty((k, group, q.shape[2]), np.float32)
    for c in range(k):
        partial(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
                positions, tree_starts, tree_mask, window, softmax_scale, softcap, t, kh, c * chunk,
                (c + 1) * chunk, m[c], l[c], acc[c])
    merge_chunks(m, l, acc, out[t, kh * group:(kh + 1) * group])


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def partial(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
            positions, tree_starts, tree_mask, window, softmax_scale, softcap, t, kh, a, b, m, l, acc):
    # token t, kv head kh, over its visible slots a .. b (in visible's order), each query head g of the
    # group: m[g] = the largest score s_j, l[g] = sum_j exp(s_j - m[g]), acc[g] = sum_j exp(s_j - m[g]) v_j.
    # Softmax in two passes over a score buffer (no running rescale)
    D = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    seq = token_seq[t]
    start, end, num_tree = visible(positions, tree_starts, tree_mask, window, t)
    num_context = end - start
    b = min(b, num_context + num_tree)
    scores = np.empty((group, b - a), np.float32)
    row = np.empty(D, np.float32)
    qg = np.empty((group, D), np.float32)  # q is a strided view of the fused qkv output: copy once
    qg[:, :] = q[t, kh * group:(kh + 1) * group, :]
    kappa = row_kappa(k_cache.shape[3], row_code, D) if has_scale else np.float32(0.0)
    debiased = kappa > 0  # 4-bit key rows: kernels/attention/score_noise.py
    # each slot's squared row scale (0: read wide), then score_bias's [group]: one allocation (empty: unused)
    extra = np.zeros(b - a + group if debiased else 0, np.float32)
    scale2, bias = extra[:b - a], extra[b - a:]
    if debiased:
        score_bias(qg, softmax_scale, kappa, bias)
    # the context's loops written out here, not through _score/_add_value: through them the serial kernel ran
    # slower on short decode contexts
    block_size = k_cache.shape[1]
    k_wide, v_wide, shadow_of = recent.k_wide, recent.v_wide, recent.shadow_of
    first_wide = wide_start(recent, positions[t], seq)
    for j in range(start + a, start + min(b, num_context)):
        blk = block_tables[seq, j // block_size]
        o = j % block_size
        if j >= first_wide:
            load_row(k_wide, shadow_of[blk], o, kh, 0, np.float32(1.0), row)
            dots(qg, row, scores, j - start - a, np.float32(softmax_scale))
        else:
            scale = np.float32(softmax_scale) * (k_scale[blk, o, kh] if has_scale else np.float32(1.0))
            load_row(k_cache, blk, o, kh, row_code, np.float32(1.0), row)
            dots(qg, row, scores, j - start - a, scale)
            if debiased:
                scale2[j - start - a] = k_scale[blk, o, kh] * k_scale[blk, o, kh]
    n = max(0, min(b, num_context) - a)
    rank = num_context  # visible index of the next tree slot
    for i in range(tree_mask.shape[1] if b > num_context else 0):
        if tree_mask[t, i] != 0:
            if a <= rank < b:
                squared = _score(qg, k_cache, k_scale, has_scale, row_code, recent, block_tables, seq,
                                 tree_starts[t] + i, kh, softmax_scale, row, scores, n)
                if debiased:
                    scale2[n] = squared
                n += 1
            rank += 1
    if debiased:
        debias(scores, bias, scale2, 0, n)
    if softcap > 0:
        inv_cap = np.float32(1.0) / softcap
        for g in range(group):
            for j in range(n):
                scores[g, j] = softcap * tanh32(scores[g, j] * inv_cap)
    for g in range(group):
        top = NEG_BIG
        for j in range(n):
            top = max(top, scores[g, j])
        for j in range(n):  # vectorized
            scores[g, j] = exp32(scores[g, j] - top)
        m[g], l[g] = top, np.float32(0.0)
    for j in range(n):  # each head's sum in order, the heads' chains interleaved (one by one: add latency)
        for g in range(group):
            l[g] += scores[g, j]
    # the values a run of VALUE_ROWS slots at a time: widened once into a buffer that stays in L1, then each
    # head's weighted sum over it with its accumulators in registers (kernels/simd/axpy.py: the bits of the
    # loop over slots that loaded and stored acc[g, :] for every slot)
    acc[:, :] = 0
    values = np.empty((VALUE_ROWS, D), np.float32)
    weights = np.empty(VALUE_ROWS, np.float32)
    for first in range(start + a, start + min(b, num_context), VALUE_ROWS):
        rows = min(VALUE_ROWS, start + min(b, num_context) - first)
        for i in range(rows):
            blk = block_tables[seq, (first + i) // block_size]
            o = (first + i) % block_size
            if first + i >= first_wide:
                load_row(v_wide, shadow_of[blk], o, kh, 0, np.float32(1.0), values[i])
            else:
                scale = v_scale[blk, o, kh] if has_scale else np.float32(1.0)
                load_row(v_cache, blk, o, kh, row_code, scale, values[i])
        for g in range(group):
            weights[:rows] = scores[g, first - start - a:first - start - a + rows]
            weighted_sum(weights, values, 0, rows, acc[g])
    n = max(0, min(b, num_context) - a)
    rank = num_context
    for i in range(tree_mask.shape[1] if b > num_context else 0):
        if tree_mask[t, i] != 0:
            if a <= rank < b:
                _add_value(v_cache, v_scale, has_scale, row_code, recent, block_tables, seq,
                           tree_starts[t] + i, kh, row, scores, n, acc)
                n += 1
            rank += 1


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def merge_chunks(m, l, acc, out):
    # m, l: [k, group]; acc: [k, group, D], partials of consecutive chunks -> out: [group, D], by the
    # log-sum-exp rule: sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c, M = max_c m_c, in chunk order
    for g in range(out.shape[0]):
        top = NEG_BIG
        for c in range(m.shape[0]):
            top = max(top, m[c, g])
        denom = np.float32(0.0)
        for c in range(m.shape[0]):
            denom += exp32(m[c, g] - top) * l[c, g]
        inv = np.float32(1.0) / denom
        out[g, :] = 0
        for c in range(m.shape[0]):
            w = exp32(m[c, g] - top) * inv
            for d in range(out.shape[1]):
                out[g, d] += w * acc[c, g, d]


@njit(inline="always", nogil=True, fastmath=FASTMATH, error_model="numpy")
def _score(qg, k_cache, k_scale, has_scale, row_code, recent, block_tables, seq, j, kh, softmax_scale, row,
           scores, column):
    # scores[:, column] = q . k_j for tree slot j of the sequence, each query head of the group -> the
    # squared scale of the row read (0: read wide)
    block_size = k_cache.shape[1]
    b = block_tables[seq, j // block_size]
    o = j % block_size
    # a tree slot is read wide under a window (its drafts are within a group of the query)
    if recent.group > 0:
        load_row(recent.k_wide, recent.shadow_of[b], o, kh, 0, np.float32(1.0), row)
        dots(qg, row, scores, column, np.float32(softmax_scale))
        return np.float32(0.0)
    row_scale = k_scale[b, o, kh] if has_scale else np.float32(1.0)
    load_row(k_cache, b, o, kh, row_code, np.float32(1.0), row)
    dots(qg, row, scores, column, np.float32(softmax_scale) * row_scale)
    return row_scale * row_scale


@njit(inline="always", nogil=True, fastmath=FASTMATH, error_model="numpy")
def _add_value(v_cache, v_scale, has_scale, row_code, recent, block_tables, seq, j, kh, row, scores, column,
               acc):
    # acc += p * v_j for tree slot j, p = scores[:, column]
    block_size = v_cache.shape[1]
    b = block_tables[seq, j // block_size]
    o = j % block_size
    if recent.group > 0:
        load_row(recent.v_wide, recent.shadow_of[b], o, kh, 0, np.float32(1.0), row)
    else:
        load_row(v_cache, b, o, kh, row_code, v_scale[b, o, kh] if has_scale else np.float32(1.0), row)
    for g in range(acc.shape[0]):
        p = scores[g, column]
        for d in range(row.shape[0]):
            acc[g, d] += p * row[d]


def load_row(cache, b, o, kh, row_code, scale, row):
    """row[:] = the values of cache[b, o, kh] as float32, times scale (numba-only)."""
    raise NotImplementedError("numba-only")


@overload(load_row, inline="always")
def _load_row_impl(cache, b, o, kh, row_code, scale, row):
    if cache.dtype != types.uint8:
        def widen(cache, b, o, kh, row_code, scale, row):
            for d in range(row.shape[0]):
                row[d] = as_f32(cache[b, o, kh, d]) * scale
        return widen

    def decode(cache, b, o, kh, row_code, scale, row):
        if cache.shape[3] == row.shape[0] and row_code == 0:  # int8: one two's complement code a value
            for d in range(row.shape[0]):
                row[d] = np.float32(np.int8(cache[b, o, kh, d])) * scale
        elif cache.shape[3] == row.shape[0]:  # fp8: one code a value
            shift, mask = fp8_placement(row_code)
            factor = fp8_row_factor(row_code, scale)
            if factor > 0:  # (value * 2^(bias - 127)) * (2^(127 - bias) * scale): one rounding, as below
                for d in range(row.shape[0]):
                    row[d] = fp8_as_f32(cache[b, o, kh, d], shift, mask) * factor
            else:
                unbias = fp8_unbias(row_code)
                for d in range(row.shape[0]):  # (value * 2^(bias - 127)) * 2^(127 - bias): exact, then scaled
                    row[d] = fp8_as_f32(cache[b, o, kh, d], shift, mask) * unbias * scale
        elif row_code == GAUSS4:  # int4_hadamard: two codebook indices a byte
            for i in range(cache.shape[3]):
                code = np.int32(cache[b, o, kh, i])
                row[2 * i] = GAUSS4_LEVELS[code & 15] * scale
                row[2 * i + 1] = GAUSS4_LEVELS[code >> 4] * scale
        else:  # int4: two codes a byte
            for i in range(cache.shape[3]):
                code = np.int32(cache[b, o, kh, i])
                row[2 * i] = np.float32((code & 15) - 8) * scale
                row[2 * i + 1] = np.float32((code >> 4) - 8) * scale
    return decode
