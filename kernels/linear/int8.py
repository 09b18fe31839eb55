"""y = x @ W.T with x quantized to int8 (kernels/formats/int8_layout.py) and q8_0 / q4_0 weights in the packed
layout.

Parallel tasks own output rows; each row's register block walks a chunk of tokens a block at a time while the
chunk of x stays in L2 (2 or 3 rows a block ran slower under AVX2: their accumulators no longer fit the 16
vector registers). matmul_int8 (AVX2): q8_0 through vpmaddwd on int16 activations (kernels/simd/int8.py), q4_0
through vpmaddubsw on int8 activations (kernels/simd/u8s8.py). matmul_vnni (AVX512-VNNI): both formats through
vpdpbusd on int8 activations, the tokens in pairs (kernels/formats/token_pairs.py) 6 at a time on 512-bit
vectors (kernels/simd/vnni_wide.py), then 4 or 2, a last odd one on 256-bit ones (kernels/simd/vnni.py): the
same bits as matmul_int8.
"""

from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.token_pairs import PAIR_BLOCK_TOKENS, pair_tokens, whole_batch
from kernels.linear.chunking import token_chunk
from kernels.moe.expert_tasks import expert_num_tasks, expert_task
from kernels.simd.int8 import int8_block
from kernels.simd.u8s8 import u8s8_block
from kernels.simd.vnni import ROWS as VNNI_ROWS
from kernels.simd.vnni import vnni_block
from kernels.simd.vnni_wide import vnni_block_wide


@njit(cache=True, nogil=True, parallel=True)
def matmul_int8(xq, xd, xsum, data, scales, out, x_chunk_bytes):
    # xq: [T, Kp] int16 (q8_0) | int8 (q4_0), xd/xsum: [T, Kp // 32], data/scales: one packed weight,
    # out: [T, N] f32; x_chunk_bytes: kernels/linear/chunking.py
    T, Kp = xq.shape
    chunk = token_chunk(xq.itemsize * Kp, 4, x_chunk_bytes)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        for n in prange(out.shape[1]):
            _row(xq, xd, xsum, data, scales, out, n, c0, c1)


def _row(xq, xd, xsum, data, scales, out, n, c0, c1):
    raise NotImplementedError("numba-only")


@overload(_row, inline="always")
def _row_impl(xq, xd, xsum, data, scales, out, n, c0, c1):
    if data.dtype == types.uint8:  # q4_0
        def impl(xq, xd, xsum, data, scales, out, n, c0, c1):
            t = c0
            while t + 4 <= c1:
                u8s8_block(xq, xd, xsum, data, scales, out, t, n, 4)
                t += 4
            if c1 - t == 3:
                u8s8_block(xq, xd, xsum, data, scales, out, t, n, 3)
            elif c1 - t == 2:
                u8s8_block(xq, xd, xsum, data, scales, out, t, n, 2)
            elif c1 - t == 1:
                u8s8_block(xq, xd, xsum, data, scales, out, t, n, 1)
        return impl

    def impl(xq, xd, xsum, data, scales, out, n, c0, c1):
        t = c0
        while t + 4 <= c1:
            int8_block(xq, xd, xsum, data, scales, out, t, n, 1, 4)
            t += 4
        if c1 - t == 3:
            int8_block(xq, xd, xsum, data, scales, out, t, n, 1, 3)
        elif c1 - t == 2:
            int8_block(xq, xd, xsum, data, scales, out, t, n, 1, 2)
        elif c1 - t == 1:
            int8_block(xq, xd, xsum, data, scales, out, t, n, 1, 1)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_vnni(xq, xd, xsum, data, scales, out, bits, x_chunk_bytes):
    # xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32], data: uint8 q8_0 [N4, Kp] (bits 8) | q4_0
    # [N4, Kp // 2] (bits 4) in 4-row blocks (int8_layout.pack_q8_0_quads, pack_q4_0), scales: [N4, Kp // 32],
    # out: [T, N] f32, N4 = N rounded up to 4. A task owns a block of 4 output rows (kernels/simd/vnni.py).
    # With the weights from memory it is memory-bound up to 8 tokens (benchmarks/results/HISTORY.md).
    T, Kp = xq.shape
    if T > 1:  # one token is its own pairing
        xq, xd, xsum = pair_tokens(xq, xd, xsum, whole_batch(T))
    chunk = token_chunk(Kp, PAIR_BLOCK_TOKENS, x_chunk_bytes)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        for task in prange(data.shape[0] // VNNI_ROWS):
            if bits == 4:
                _vnni_tokens(xq, xd, xsum, data, scales, out, task * VNNI_ROWS, c0, c1, 4)
            else:
                _vnni_tokens(xq, xd, xsum, data, scales, out, task * VNNI_ROWS, c0, c1, 8)


def _vnni_tokens(xq, xd, xsum, data, scales, out, n, c0, c1, bits):
    raise NotImplementedError("numba-only")


@overload(_vnni_tokens, inline="always", prefer_literal=True)
def _vnni_tokens_impl(xq, xd, xsum, data, scales, out, n, c0, c1, bits):
    if not isinstance(bits, types.IntegerLiteral):
        return None
    b = bits.literal_value

    def impl(xq, xd, xsum, data, scales, out, n, c0, c1, bits):
        # xq, xd, xsum paired from row c0 (even from the segment's start)
        t = c0
        while t + PAIR_BLOCK_TOKENS <= c1:
            vnni_block_wide(xq, xd, xsum, data, scales, out, t, n, b, 3)
            t += PAIR_BLOCK_TOKENS
        if c1 - t >= 4:
            vnni_block_wide(xq, xd, xsum, data, scales, out, t, n, b, 2)
            t += 4
        elif c1 - t >= 2:
            vnni_block_wide(xq, xd, xsum, data, scales, out, t, n, b, 1)
            t += 2
        if c1 - t == 1:  # a segment's odd last row, as it was
            vnni_block(xq, xd, xsum, data, scales, out, t, n, b, 1)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_vnni_experts(xq, xd, xsum, data, scales, out, bits, experts, starts):
    # Several experts' matmul_vnni in one parallel region (kernels/moe/expert_tasks.py: the layout of
    # data/scales, experts, starts; the tasks); out: [R, N] f32
    N = out.shape[1]
    if xq.shape[0] > 1:
        xq, xd, xsum = pair_tokens(xq, xd, xsum, starts)
    for task in prange(expert_num_tasks(experts.shape[0], N, VNNI_ROWS)):
        e, r0, r1, b0, b1 = expert_task(task, experts, starts, N, VNNI_ROWS)
        d, c = data[e * N:(e + 1) * N], scales[e * N:(e + 1) * N]
        x, xs, xt, o = xq[r0:r1], xd[r0:r1], xsum[r0:r1], out[r0:r1]
        for b in range(b0, b1):
            if bits == 4:
                _vnni_tokens(x, xs, xt, d, c, o, b * VNNI_ROWS, 0, r1 - r0, 4)
            else:
                _vnni_tokens(x, xs, xt, d, c, o, b * VNNI_ROWS, 0, r1 - r0, 8)
