"""Prefill attention in tiles: a tile is a run of consecutive rows of one sequence at consecutive positions
(not tree nodes), taken with the query heads of one KV head (GQA) against its chunks of key positions.

Each key and value row of a chunk is read and widened once for the whole tile into small buffers (the
per-token kernel widens it once for every token that sees it), which each row of the tile then reads; the
value sums keep their accumulators in registers (kernels/simd/axpy.py). A row's chunks are its own
(kernels/attention/paged.py's rule: CHUNK visible slots counted from its first visible slot, so a sliding
window shifts them row by row): the tile widens the union of its rows' chunk c, at most CHUNK + rows - 1 keys,
and each row reads the slice that is its chunk. Scores, softmax and value sums are the per-token kernel's
arithmetic in its order (kernels/attention/chunks.py), then the same merge, so a token's bits do not depend on
its tile, batch or thread count, and prefill and decode of a position agree bit for bit. Rows of a tree, or
alone in their tile, take the per-token path.
"""

import numpy as np
from numba import njit, prange

from kernels.attention.chunks import (
    FASTMATH,
    NEG_BIG,
    attend,
    load_row,
    merge_chunks,
    num_chunks,
    visible,
    wide_start,
)
from kernels.attention.score_noise import debias, row_kappa, score_bias
from kernels.exp32 import exp32, tanh32
from kernels.simd.axpy import weighted_sum
from kernels.simd.dot import dots


@njit(cache=True, nogil=True)
def row_tiles(token_seq, positions, tree_starts, tile_rows, group):
    # -> bounds [num_tiles + 1] int64: tile i is rows bounds[i] .. bounds[i + 1]; a row starts a new tile
    # when the tile is full, its sequence differs, its position does not follow, either row is a tree node,
    # or (group > 0) its position starts a group of the recent window (a tile's rows read the same slots wide)
    T = token_seq.shape[0]
    bounds = np.empty(T + 1, np.int64)
    bounds[0] = 0
    n = 1
    for t in range(1, T):
        if (t - bounds[n - 1] >= tile_rows or token_seq[t] != token_seq[t - 1]
                or positions[t] != positions[t - 1] + 1 or tree_starts[t] >= 0 or tree_starts[t - 1] >= 0
                or (group > 0 and positions[t] % group == 0)):
            bounds[n] = t
            n += 1
    bounds[n] = T
    return bounds[:n + 1]


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH, error_model="numpy")
def attention_tiled(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                    token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk,
                    bounds, out):
    # kernels/attention/paged.py's arguments, and bounds: row_tiles'; every (tile, kv head) a task
    num_tiles, n_kv = bounds.shape[0] - 1, k_cache.shape[2]
    for task in prange(num_tiles * n_kv):
        tt = task // n_kv
        i = tt // 2 if tt % 2 == 0 else num_tiles - 1 - tt // 2  # short tiles paired with long ones
        kh = task - tt * n_kv
        if bounds[i + 1] - bounds[i] == 1:
            attend(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                   token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk, out,
                   bounds[i], kh)
        else:
            _attend_tile(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables,
                         token_seq, positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk,
                         out, bounds[i], bounds[i + 1], kh)


@njit(cache=True, nogil=True, fastmath=FASTMATH, error_model="numpy")
def _attend_tile(q, k_cache, v_cache, k_scale, v_scale, has_scale, row_code, recent, block_tables, token_seq,
                 positions, tree_starts, tree_mask, window, softmax_scale, softcap, chunk, out, t0, t1, kh):
    # rows t0 .. t1 (one sequence, consecutive positions, no tree), kv head kh
    R, D = t1 - t0, q.shape[2]
    group = q.shape[1] // k_cache.shape[2]
    block_size = k_cache.shape[1]
    seq = token_seq[t0]
    first_wide = wide_start(recent, positions[t0], seq)  # the same for every row (row_tiles)
    starts, ends, counts = np.empty(R, np.int64), np.empty(R, np.int64), np.empty(R, np.int64)
    for r in range(R):
        start, end, _ = visible(positions, tree_starts, tree_mask, window, t0 + r)
        starts[r], ends[r], counts[r] = start, end, num_chunks(end - start, chunk)
    k = counts.max()
    qt = np.empty((R, group, D), np.float32)  # q is a strided view of the fused qkv output: copied once
    for r in range(R):
        qt[r] = q[t0 + r, kh * group:(kh + 1) * group, :]
    width = chunk + R - 1  # the rows' chunk c spans at most this many keys
    keys, values = np.empty((width, D), np.float32), np.empty((width, D), np.float32)
    key_scales = np.empty(width, np.float32)
    kappa = row_kappa(k_cache.shape[3], row_code, D) if has_scale else np.float32(0.0)
    debiased = kappa > 0  # 4-bit key rows: kernels/attention/score_noise.py
    scale2 = np.zeros(width, np.float32)  # each key's squared row scale (0: read wide)
    bias = np.empty((R, group), np.float32)
    if debiased:
        for r in range(R):
            score_bias(qt[r], softmax_scale, kappa, bias[r])
    scores = np.empty((R, group, width), np.float32)
    m, l = np.empty((k, R, group), np.float32), np.empty((k, R, group), np.float32)
    acc = np.empty((k, R, group, D), np.float32)
    for c in range(k):
        lo, hi = ends[R - 1], starts[0]  # the union [lo, hi) of the rows' chunk c
        for r in range(R):
            if c < counts[r]:
                lo = min(lo, starts[r] + c * chunk)
                hi = max(hi, min(ends[r], starts[r] + (c + 1) * chunk))
        for j in range(lo, hi):  # the chunk's key and value rows widened once: keys[j - lo], values[j - lo]
            blk = block_tables[seq, j // block_size]
            o = j % block_size
            if j >= first_wide:
                key_scales[j - lo], scale2[j - lo] = np.float32(softmax_scale), np.float32(0.0)
                load_row(recent.k_wide, recent.shadow_of[blk], o, kh, 0, np.float32(1.0), keys[j - lo])
                load_row(recent.v_wide, recent.shadow_of[blk], o, kh, 0, np.float32(1.0), values[j - lo])
                continue
            row_scale = k_scale[blk, o, kh] if has_scale else np.float32(1.0)
            key_scales[j - lo], scale2[j - lo] = np.float32(softmax_scale) * row_scale, row_scale * row_scale
            load_row(k_cache, blk, o, kh, row_code, np.float32(1.0), keys[j - lo])
            load_row(v_cache, blk, o, kh, row_code, v_scale[blk, o, kh] if has_scale else np.float32(1.0),
                     values[j - lo])
        # row by row (its [group, width] scores stay in L1; the [R x group, width] block of the tile did not)
        for r in range(R):
            if c >= counts[r]:
                continue
            a = starts[r] + c * chunk - lo  # row r's chunk c: keys a .. b of the buffers
            b = min(ends[r], starts[r] + (c + 1) * chunk) - lo
            for j in range(a, b):
                dots(qt[r], keys[j], scores[r], j, key_scales[j])
            if debiased:
                debias(scores[r], bias[r], scale2, a, b)
            for g in range(group):
                # the row's chunk as a view from 0: loops from a non-zero start kept numba's negative-index
                # check and LLVM left them scalar (the tile 1.3x slower at 512 tokens: HISTORY.md)
                row = scores[r, g, a:b]
                if softcap > 0:
                    inv_cap = np.float32(1.0) / softcap
                    for j in range(row.shape[0]):
                        row[j] = softcap * tanh32(row[j] * inv_cap)
                top = NEG_BIG
                for j in range(row.shape[0]):
                    top = max(top, row[j])
                for j in range(row.shape[0]):  # vectorized
                    row[j] = exp32(row[j] - top)
                m[c, r, g], l[c, r, g] = top, np.float32(0.0)
            for j in range(a, b):  # each head's sum in order, the heads' chains interleaved (as attend does)
                for g in range(group):
                    l[c, r, g] += scores[r, g, j]
            for g in range(group):
                acc[c, r, g] = 0
                weighted_sum(scores[r, g], values, a, b, acc[c, r, g])
    for r in range(R):
        n = counts[r]
        merge_chunks(m[:n, r], l[:n, r], acc[:n, r], out[t0 + r, kh * group:(kh + 1) * group])
