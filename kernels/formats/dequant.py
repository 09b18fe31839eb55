"""Dequantize weight rows of any served format into float32 (embeddings, export, tests).

The matmul kernel unpacks the same layouts in registers (kernels/simd/block.py); tests/kernels/test_quant.py
holds it to this definition and this one to the gguf package's.

data/scales per format: float32 [N, K] / unused; bf16 bits uint16 [N, K] / unused; q8_0 int8 [N, K] /
fp16 bits uint16 [N, K // 32]; q4_0 uint8 [N, K // 2] (GGML nibble order) / fp16 bits uint16 [N, K // 32].
"""

import numpy as np
from numba import njit, types
from numba.extending import overload

from kernels.formats.bf16 import bf16_to_f32
from kernels.formats.fp16 import f16_to_f32


def dequantize_row(data, scales, n, dst):
    raise NotImplementedError("numba-only")


@overload(dequantize_row, inline="always")
def _dequantize_row(data, scales, n, dst):
    dt = data.dtype
    if dt == types.float32:
        def impl(data, scales, n, dst):
            for k in range(dst.shape[0]):
                dst[k] = data[n, k]
    elif dt == types.uint16:  # bf16 bits
        def impl(data, scales, n, dst):
            for k in range(dst.shape[0]):
                dst[k] = bf16_to_f32(data[n, k])
    elif dt == types.int8:  # q8_0
        def impl(data, scales, n, dst):
            for b in range(dst.shape[0] // 32):
                d = f16_to_f32(scales[n, b])
                for j in range(32):
                    dst[b * 32 + j] = d * np.float32(data[n, b * 32 + j])
    elif dt == types.uint8:  # q4_0, GGML nibble order
        def impl(data, scales, n, dst):
            for b in range(dst.shape[0] // 32):
                d = f16_to_f32(scales[n, b])
                for j in range(16):
                    byte = data[n, b * 16 + j]
                    dst[b * 32 + j] = d * np.float32(np.int32(byte & 15) - 8)
                    dst[b * 32 + j + 16] = d * np.float32(np.int32(byte >> 4) - 8)
    else:
        return None
    return impl


@njit(cache=True, nogil=True)
def dequantize_rows(data, scales, row_start, dst):
    # rows row_start .. row_start + R of a weight -> dst: [R, K] f32
    for r in range(dst.shape[0]):
        dequantize_row(data, scales, row_start + r, dst[r])
