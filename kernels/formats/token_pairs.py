"""Token pairs side by side: quantized activations (kernels/formats/int8_layout.py) as the 512-bit VNNI block
reads them (kernels/simd/vnni_wide.py), one load for both tokens of a pair.

Within a segment of rows (from its first row: 2i and 2i + 1 form pair i), a pair's two rows are interleaved
every 32 values of xq (a vector of the quad order) and every 8 values of xd and xsum (a group's blocks): the
64 bytes at vector v of the pair hold vector v of the first row, then vector v of the second. A pair occupies
its own two rows' bytes; a segment's last row, when its count is odd, stays as it is, so the 1-token block
reads it where it was. Segments: [S + 1] int64 starts (a batch is one segment, each expert's rows one in a
MoE layer: kernels/moe/expert_tasks.py).

    xq: [T, Kp] int8, xd / xsum: [T, Kp // 32] f32 / int32 -> the same shapes, rows paired
"""

import numpy as np
from numba import njit, prange

VALUES = 32  # xq values a row contributes to each 64-byte vector of its pair
BLOCKS = 8  # xd / xsum values a row contributes to each group of its pair
# tokens a 512-bit block takes (3 pairs: kernels/simd/vnni_wide.py), the step of the drivers that pair tokens
# (kernels/linear/int8.py, kquant.py) and the multiple their chunks of x are cut to
PAIR_BLOCK_TOKENS = 6
PARALLEL_MIN_TOKENS = 16  # as int8_layout's: waking the threads costs more than pairing a few rows


@njit(cache=True, nogil=True)
def pair_tokens(xq, xd, xsum, starts):
    # -> (pq, pd, psum): xq, xd, xsum with each segment's rows paired (the module docstring)
    pq, pd, psum = np.empty_like(xq), np.empty_like(xd), np.empty_like(xsum)
    if xq.shape[0] < PARALLEL_MIN_TOKENS:
        for t in range(xq.shape[0]):
            _row(xq, xd, xsum, starts, pq, pd, psum, t)
    else:
        _rows_parallel(xq, xd, xsum, starts, pq, pd, psum)
    return pq, pd, psum


@njit(cache=True, nogil=True, parallel=True)
def _rows_parallel(xq, xd, xsum, starts, pq, pd, psum):
    for t in prange(xq.shape[0]):
        _row(xq, xd, xsum, starts, pq, pd, psum, t)


@njit(inline="always", nogil=True)
def _row(xq, xd, xsum, starts, pq, pd, psum, t):
    # row t's part: a pair's first row writes the pair, a segment's odd last row itself
    s = np.searchsorted(starts, t, side="right") - 1
    if s < 0 or s >= starts.shape[0] - 1 or (t - starts[s]) % 2 == 1:
        return  # outside every segment, or the second row of a pair (written with the first)
    if t + 1 < starts[s + 1]:
        _pair(xq, t, pq, VALUES)
        _pair(xd, t, pd, BLOCKS)
        _pair(xsum, t, psum, BLOCKS)
    else:
        pq[t], pd[t], psum[t] = xq[t], xd[t], xsum[t]


@njit(inline="always", nogil=True)
def _pair(a, t, out, width):
    # rows t, t + 1 of a: [T, C] -> out's same rows, interleaved every `width` values
    C = a.shape[1]
    flat = out[t:t + 2].reshape(2 * C)
    for v in range(C // width):
        for h in range(2):
            for e in range(width):
                flat[(2 * v + h) * width + e] = a[t + h, v * width + e]


@njit(cache=True, nogil=True)
def whole_batch(num_tokens):
    # the segments of a batch of num_tokens rows: one
    return np.array([0, num_tokens], np.int64)
