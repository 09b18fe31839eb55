"""Paged attention over a flat token batch, and the KV-cache writes that feed it.

KV cache of one layer: [num_blocks, block_size, n_kv_heads, head_dim] as float32, bfloat16 bits
(uint16) or int8, or uint8 codes (fp8: one code a value; int4: [.., head_dim // 2], two a byte, low nibble
first, n - 8), the integer and code forms with one float32 scale per (slot, kv head); each row is widened to
float32 as it is read (memory/kv_formats.py names the dtypes). A token reads its sequence's
KV through block_tables[token_seq[t]]; prefill, chunked prefill and decode are the same call.

A token sees its sequence's slots 0 .. positions[t] (within the window), unless it is a node of a token
tree being verified (tree_starts[t] >= 0): then it sees the slots before the tree, and of the tree's slots
tree_starts[t] + i those its mask row marks (its ancestors and itself). Its position (RoPE's, and the
window's) is then the tree's start plus its depth, not its slot. A chain of drafts is the special case of
a lower-triangular mask, and gives the same bits as plain positions.
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kernels.bf16 import as_f32, f32_to_bf16
from kernels.exp32 import exp32, tanh32
from kernels.fp8 import fp8_as_bf16, fp8_unbias
from kernels.kv_quant import row_scale
from kernels.simd_dot import dots

_NEG_BIG = np.float32(-3.0e38)  # stands in for -inf (fastmath assumes no infinities)
# fastmath without "reassoc": every sum in the order written (the scores' dot products in
# kernels/simd_dot.py), so the serial and the parallel kernel give a token the same bits (with "reassoc" they
# did not). "arcp" stays (the reciprocal once per row: no order to keep), and "afn" (per element; while exp
# was libm's expf, without the two this ran at half speed: decode, 512 positions, TinyLlama heads, 0.54
# against 0.30 ms per layer); the softmax's exp is now kernels/exp32.py's arithmetic, which vectorizes
_FASTMATH = {"contract", "nnan", "ninf", "nsz", "afn", "arcp"}


PARALLEL_MIN_WORK = 1 << 15  # query-head x key pairs below which waking the threads costs more than it saves


_NO_TREE_MASK = np.zeros((1, 0), np.uint8)


def paged_attention(q, k_cache, v_cache, k_scale, v_scale, has_scale, block_tables, token_seq, positions,
                    window, softmax_scale, out, tree_starts=None, tree_mask=None, softcap=0.0, fp8_mbits=0):
    # q: [T, n_heads, D] f32; k_cache, v_cache: [num_blocks, block_size, n_kv, D]
    # k_scale, v_scale: [num_blocks, block_size, n_kv] f32 (read only when has_scale)
    # block_tables: [S, max_blocks] int32; token_seq: [T] int32; positions: [T] int32
    # window: attend to the last `window` positions (0 = all); out: [T, n_heads, D] f32
    # softcap: scores s -> softcap * tanh(s / softcap) before the softmax (Gemma 2), 0 = none
    # tree_starts: [T] int32, the slot where token t's tree begins (-1: not a tree node); tree_mask: [T, W]
    # uint8, 1 where tree slot tree_starts[t] + i is visible to t (the caller leaves out what the window does)
    # fp8_mbits: mantissa bits, 3 (e4m3fn) or 2 (e5m2), of a uint8 cache of one code a value (kernels/fp8.py)
    if q.shape[0] == 0:
        return
    if tree_starts is None:
        tree_starts, tree_mask = np.full(q.shape[0], -1, np.int32), _NO_TREE_MASK
    work = q.shape[0] * q.shape[1] * (int(positions.max()) + 1 + tree_mask.shape[1])
    kernel = _attention_parallel if work >= PARALLEL_MIN_WORK else _attention_serial
    kernel(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq, positions,
           tree_starts, tree_mask, window, softmax_scale, np.float32(softcap), out)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FASTMATH, error_model="numpy")
def _attention_parallel(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq,
                        positions, tree_starts, tree_mask, window, softmax_scale, softcap, out):
    T, n_kv = q.shape[0], k_cache.shape[2]
    for task in prange(T * n_kv):
        tt = task // n_kv
        t = tt // 2 if tt % 2 == 0 else T - 1 - tt // 2  # 0, T-1, 1, T-2, ...: prefill rows grow with t,
        # and each thread takes a contiguous range of tasks, so pairing short with long rows balances them
        _attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq,
                positions, tree_starts, tree_mask, window, softmax_scale, softcap, out, t, task - tt * n_kv)


@njit(cache=True, nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _attention_serial(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq,
                      positions, tree_starts, tree_mask, window, softmax_scale, softcap, out):
    for t in range(q.shape[0]):
        for kh in range(k_cache.shape[2]):
            _attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq,
                    positions, tree_starts, tree_mask, window, softmax_scale, softcap, out, t, kh)


@njit(inline="always", nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, fp8_mbits, block_tables, token_seq, positions,
            tree_starts, tree_mask, window, softmax_scale, softcap, out, t, kh):
    # token t, kv head kh, for its whole group of query heads: each key and value row is read and widened
    # once; softmax in two passes over a score buffer (no running rescale). Visible slots, in this order:
    # context [start, end), then the tree slots its mask marks (none for a token outside a tree).
    D = q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    seq = token_seq[t]
    tree_start = tree_starts[t]
    end = positions[t] + 1 if tree_start < 0 else tree_start
    start = min(max(0, positions[t] + 1 - window) if window > 0 else 0, end)
    width = tree_mask.shape[1] if tree_start >= 0 else 0  # the tree's slots
    num_tree = 0
    for i in range(width):
        num_tree += tree_mask[t, i] != 0
    scores = np.empty((group, end - start + num_tree), np.float32)
    row = np.empty(D, np.float32)
    qg = np.empty((group, D), np.float32)  # q is a strided view of the fused qkv output: copy once
    qg[:, :] = q[t, kh * group:(kh + 1) * group, :]
    acc = np.zeros((group, D), np.float32)
    # the context's loops written out here, not through _score/_add_value: through them the serial kernel ran
    # 3.3x slower on short decode contexts (demo model, batch 16: 0.34 against 0.10 ms a call)
    block_size = k_cache.shape[1]
    for j in range(start, end):
        b = block_tables[seq, j // block_size]
        o = j % block_size
        scale = np.float32(softmax_scale) * (k_scale[b, o, kh] if has_scale else np.float32(1.0))
        load_row(k_cache, b, o, kh, fp8_mbits, np.float32(1.0), row)
        dots(qg, row, scores, j - start, scale)
    n = end - start
    for i in range(width):
        if tree_mask[t, i] != 0:
            _score(qg, k_cache, k_scale, has_scale, fp8_mbits, block_tables, seq, tree_start + i, kh,
                   softmax_scale, row, scores, n)
            n += 1
    if softcap > 0:
        inv_cap = np.float32(1.0) / softcap
        for g in range(group):
            for j in range(n):
                scores[g, j] = softcap * tanh32(scores[g, j] * inv_cap)
    for g in range(group):
        m = _NEG_BIG
        for j in range(n):
            m = max(m, scores[g, j])
        denom = np.float32(0.0)
        for j in range(n):  # vectorized, then summed in order
            scores[g, j] = exp32(scores[g, j] - m)
        for j in range(n):
            denom += scores[g, j]
        inv = np.float32(1.0) / denom
        for j in range(n):
            scores[g, j] *= inv
    for j in range(start, end):
        b = block_tables[seq, j // block_size]
        o = j % block_size
        load_row(v_cache, b, o, kh, fp8_mbits, v_scale[b, o, kh] if has_scale else np.float32(1.0), row)
        for g in range(group):
            p = scores[g, j - start]
            for d in range(D):
                acc[g, d] += p * row[d]
    n = end - start
    for i in range(width):
        if tree_mask[t, i] != 0:
            _add_value(v_cache, v_scale, has_scale, fp8_mbits, block_tables, seq, tree_start + i, kh, row,
                       scores, n, acc)
            n += 1
    out[t, kh * group:(kh + 1) * group, :] = acc


@njit(inline="always", nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _score(qg, k_cache, k_scale, has_scale, fp8_mbits, block_tables, seq, j, kh, softmax_scale, row, scores,
           column):
    # scores[:, column] = q . k_j for slot j of the sequence, each query head of the group
    block_size = k_cache.shape[1]
    b = block_tables[seq, j // block_size]
    o = j % block_size
    scale = np.float32(softmax_scale) * (k_scale[b, o, kh] if has_scale else np.float32(1.0))
    load_row(k_cache, b, o, kh, fp8_mbits, np.float32(1.0), row)
    dots(qg, row, scores, column, scale)


@njit(inline="always", nogil=True, fastmath=_FASTMATH, error_model="numpy")
def _add_value(v_cache, v_scale, has_scale, fp8_mbits, block_tables, seq, j, kh, row, scores, column, acc):
    # acc += p * v_j for slot j, p = scores[:, column]
    block_size = v_cache.shape[1]
    b = block_tables[seq, j // block_size]
    o = j % block_size
    load_row(v_cache, b, o, kh, fp8_mbits, v_scale[b, o, kh] if has_scale else np.float32(1.0), row)
    for g in range(acc.shape[0]):
        p = scores[g, column]
        for d in range(row.shape[0]):
            acc[g, d] += p * row[d]


def load_row(cache, b, o, kh, fp8_mbits, scale, row):
    """row[:] = the values of cache[b, o, kh] as float32, times scale (numba-only)."""
    raise NotImplementedError("numba-only")


@overload(load_row, inline="always")
def _load_row_impl(cache, b, o, kh, fp8_mbits, scale, row):
    if cache.dtype != types.uint8:
        def widen(cache, b, o, kh, fp8_mbits, scale, row):
            for d in range(row.shape[0]):
                row[d] = as_f32(cache[b, o, kh, d]) * scale
        return widen

    def decode(cache, b, o, kh, fp8_mbits, scale, row):
        if cache.shape[3] == row.shape[0]:  # fp8: one code a value
            unbias = fp8_unbias(fp8_mbits)
            for d in range(row.shape[0]):  # (value * 2^(bias - 127)) * 2^(127 - bias): exact, then scaled
                row[d] = fp8_as_bf16(cache[b, o, kh, d], fp8_mbits) * unbias * scale
        else:  # int4: two codes a byte
            for i in range(cache.shape[3]):
                code = np.int32(cache[b, o, kh, i])
                row[2 * i] = np.float32((code & 15) - 8) * scale
                row[2 * i + 1] = np.float32((code >> 4) - 8) * scale
    return decode


@njit(cache=True, nogil=True)
def write_kv(k, v, slot_mapping, k_cache, v_cache):
    # k, v: [T, n_kv, D] f32 -> caches [num_blocks, block_size, n_kv, D] (float32 or uint16 bf16 bits)
    block_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        b = slot_mapping[t] // block_size
        o = slot_mapping[t] % block_size
        for h in range(k.shape[1]):
            for d in range(k.shape[2]):
                k_cache[b, o, h, d] = _store(k[t, h, d], k_cache[b, o, h, d])
                v_cache[b, o, h, d] = _store(v[t, h, d], v_cache[b, o, h, d])


def _store(value, like):
    raise NotImplementedError("numba-only")


@overload(_store, inline="always")
def _store_impl(value, like):
    if like == types.uint16:
        return lambda value, like: f32_to_bf16(value)
    return lambda value, like: value


@njit(cache=True, nogil=True)
def write_kv_int8(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale):
    # symmetric int8 per (token, kv head): x ~= q * scale, scale = max|x| / 127
    block_size = k_cache.shape[1]
    for t in range(k.shape[0]):
        b = slot_mapping[t] // block_size
        o = slot_mapping[t] % block_size
        for h in range(k.shape[1]):
            k_scale[b, o, h] = _quantize_row(k[t, h], k_cache[b, o, h])
            v_scale[b, o, h] = _quantize_row(v[t, h], v_cache[b, o, h])


@njit(inline="always", nogil=True)
def _quantize_row(x, dst):
    scale, inv = row_scale(x, 127.0)
    for d in range(x.shape[0]):
        dst[d] = np.int8(round(x[d] * inv))
    return scale
