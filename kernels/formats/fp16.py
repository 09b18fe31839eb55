"""IEEE half precision kept as 16-bit patterns (GGML block scales: uint16; float16 weights: int16 in the
kernels): LLVM's exact conversions."""

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        return builder.fpext(builder.bitcast(low, ir.HalfType()), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_to_f16_bits(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(types.float32), codegen


@njit(inline="always", nogil=True)
def f16_to_f32(bits):
    return _f16_bits_to_f32(bits)


@njit(inline="always", nogil=True)
def f32_to_f16(value):
    """Round to nearest even, subnormals and overflow as IEEE (numpy's astype(float16))."""
    return _f32_to_f16_bits(value)


@njit(inline="always", nogil=True)
def put_f16(block, at, value):
    """value rounded to fp16 into the uint8 bytes block[at], block[at + 1] (little-endian, as GGML blocks
    store it); returns the rounded value as float32."""
    bits = f32_to_f16(value)
    block[at], block[at + 1] = bits & 255, bits >> 8
    return f16_to_f32(bits)


def f16_kernel_bits(a: np.ndarray) -> np.ndarray:
    """A float16 array's bytes as int16, how the kernels take float16 weights (kernels/simd/block.py): numba
    has no float16 arrays on the CPU, and uint16 already means bf16 bits there. A view, no copy."""
    return a.view(np.int16)
