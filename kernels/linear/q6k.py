"""y = x @ W.T with x quantized to int8 (kernels/formats/int8_layout.py) and GGUF Q6_K weights
(kernels/formats/q6k_layout.py), through AVX512-VNNI (kernels/simd/q6k.py), or without AVX-512
(matmul_q6k_avx2: vpdpbusd's integers through vpmaddubsw and vpmaddwd, kernels/simd/vnni.py dpbusd_avx2), the
same bits.

The same quantized activations (xq, xd, xsum) as matmul_vnni's serve: the sub-block offsets the Q6_K block
needs are derived from them once per call. A task owns a block of 4 output rows for a chunk of tokens, 4 at a
time, then 2, then 1 (4 rows x 4 tokens measured best: kernels/simd/q6k.py).
"""

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.int8_layout import GROUP
from kernels.formats.q6k_layout import ROWS, subblock_offsets
from kernels.linear.chunking import token_chunk
from kernels.moe.expert_tasks import expert_num_tasks, expert_task
from kernels.simd.q6k import q6k_block


@njit(inline="always", nogil=True)
def _offsets(xq, xsum):
    offsets = np.empty((xq.shape[0], xq.shape[1] // GROUP * 16), np.int32)
    subblock_offsets(xq, xsum, offsets)
    return offsets


def _tokens(xq, xd, offsets, data, d, out, n, c0, c1, vnni):
    raise NotImplementedError("numba-only")


@overload(_tokens, inline="always", prefer_literal=True)
def _tokens_impl(xq, xd, offsets, data, d, out, n, c0, c1, vnni):
    # 4 tokens a block, then 2, then 1, with VNNI or without (AVX2: 4 x 4 spills more of its 16 registers, and
    # still ran faster than 4 x 2 or 4 x 1: benchmarks/results/HISTORY.md, "Without AVX-512")
    if not isinstance(vnni, types.IntegerLiteral):
        return None
    v = vnni.literal_value

    def impl(xq, xd, offsets, data, d, out, n, c0, c1, vnni):
        t = c0
        while t + 4 <= c1:
            q6k_block(xq, xd, offsets, data, d, out, t, n, 4, v)
            t += 4
        if c1 - t >= 2:
            q6k_block(xq, xd, offsets, data, d, out, t, n, 2, v)
            t += 2
        if c1 - t == 1:
            q6k_block(xq, xd, offsets, data, d, out, t, n, 1, v)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_q6k(xq, xd, xsum, data, d, out, x_chunk_bytes):
    # xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32], data: uint8 [N4, Kp // 256 * 208], d: uint16
    # [N4, Kp // 256] (kernels/formats/q6k_layout.py), out: [T, N] f32; x_chunk_bytes:
    # kernels/linear/chunking.py
    _matmul(xq, xd, xsum, data, d, out, 1, x_chunk_bytes)


@njit(cache=True, nogil=True, parallel=True)
def matmul_q6k_avx2(xq, xd, xsum, data, d, out, x_chunk_bytes):
    # matmul_q6k's operands and bits without AVX-512 (kernels/simd/vnni.py dpbusd_avx2)
    _matmul(xq, xd, xsum, data, d, out, 0, x_chunk_bytes)


def _matmul(xq, xd, xsum, data, d, out, vnni, x_chunk_bytes):
    raise NotImplementedError("numba-only")


@overload(_matmul, inline="always", prefer_literal=True)
def _matmul_impl(xq, xd, xsum, data, d, out, vnni, x_chunk_bytes):
    if not isinstance(vnni, types.IntegerLiteral):
        return None
    v = vnni.literal_value

    def impl(xq, xd, xsum, data, d, out, vnni, x_chunk_bytes):
        T, Kp = xq.shape
        offsets = _offsets(xq, xsum)
        chunk = token_chunk(Kp, 4, x_chunk_bytes)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            for task in prange(data.shape[0] // ROWS):
                _tokens(xq, xd, offsets, data, d, out, task * ROWS, c0, c1, v)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_q6k_experts(xq, xd, xsum, data, d, out, experts, starts):
    # Several experts' matmul_q6k in one parallel region (kernels/moe/expert_tasks.py: the layout of data/d,
    # experts, starts; the tasks); out: [R, N] f32
    N = out.shape[1]
    offsets = _offsets(xq, xsum)
    for task in prange(expert_num_tasks(experts.shape[0], N, ROWS)):
        e, r0, r1, b0, b1 = expert_task(task, experts, starts, N, ROWS)
        w, wd = data[e * N:(e + 1) * N], d[e * N:(e + 1) * N]
        x, xs, xo, o = xq[r0:r1], xd[r0:r1], offsets[r0:r1], out[r0:r1]
        for b in range(b0, b1):
            _tokens(x, xs, xo, w, wd, o, b * ROWS, 0, r1 - r0, 1)
