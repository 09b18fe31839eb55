"""y = x @ W.T with x quantized to int8 (kernels/int8_layout.py) and q8_0 / q4_0 weights in the packed layout.

Parallel tasks own output rows; each row's register block walks a chunk of tokens, 4 at a time,
while the chunk of x stays in L2: q8_0 through vpmaddwd on int16 activations (kernels/simd_int8.py),
q4_0 through vpmaddubsw on int8 activations (kernels/simd_u8s8.py).
Measured on 2 Zen 2 cores (AVX2), 5760 x 2048 weights, 48 tokens: 1 row x 4 tokens 174 GFLOP/s for q8_0,
against 100-135 for 2 or 3 rows (their accumulators no longer fit the 16 vector registers) and
~80 for the float32-activation kernel.
"""

from numba import njit, prange, types
from numba.extending import overload

from kernels.simd_int8 import int8_block
from kernels.simd_u8s8 import u8s8_block

_X_CHUNK_BYTES = 1 << 19  # tokens of x per pass over the weights: half of a core's L2


@njit(cache=True, nogil=True, parallel=True)
def matmul_int8(xq, xd, xsum, data, scales, out):
    # xq: [T, Kp] int16 (q8_0) | int8 (q4_0), xd/xsum: [T, Kp // 32], data/scales: one packed weight,
    # out: [T, N] f32
    T, Kp = xq.shape
    chunk = max(4, _X_CHUNK_BYTES // (xq.itemsize * Kp) // 4 * 4)
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
