"""IEEE half precision kept as uint16 bit patterns (GGML block scales): LLVM's exact conversions."""

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
