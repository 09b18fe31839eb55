"""bfloat16 kept as uint16 bit patterns: bit casts and round-to-nearest-even conversion."""

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

from kernels.formats.fp16 import f16_to_f32


@intrinsic
def _bf16_bits_to_f32(typingctx, bits):
    # the low 16 bits of an integer, as the high half of a float32
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        low = builder.trunc(args[0], ir.IntType(16)) if bits.bitwidth > 16 else args[0]
        wide = builder.zext(low, i32)
        return builder.bitcast(builder.shl(wide, ir.Constant(i32, 16)), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _f32_as_u32(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(inline="always", nogil=True)
def bf16_to_f32(bits):
    return _bf16_bits_to_f32(bits)


def as_f32(x):
    """A stored value (bf16 bits uint16, fp16 bits int16, int8, float) widened to float32."""
    raise NotImplementedError("numba-only")


@overload(as_f32, inline="always")
def _as_f32(x):
    if x == types.uint16:
        return lambda x: bf16_to_f32(x)
    if x == types.int16:
        return lambda x: f16_to_f32(x)
    if isinstance(x, (types.Float, types.Integer)):
        return lambda x: np.float32(x)
    return None


@njit(inline="always", nogil=True)
def f32_to_bf16(value):
    # round to nearest even, as torch does (NaN is not special-cased: weights and KV hold none)
    u = _f32_as_u32(np.float32(value))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@njit(cache=True, nogil=True, parallel=True)
def bf16_to_f32_array(src, dst):
    # src: [N] uint16 -> dst: [N] float32
    for i in prange(src.shape[0]):
        dst[i] = bf16_to_f32(src[i])


@njit(cache=True, nogil=True, parallel=True)
def f32_to_bf16_array(src, dst):
    # src: [N] float32 -> dst: [N] uint16
    for i in prange(src.shape[0]):
        dst[i] = f32_to_bf16(src[i])


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float array of any shape -> uint16 bf16 bits of the same shape (round to nearest even)."""
    flat = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty(flat.shape[0], np.uint16)
    f32_to_bf16_array(flat, out)
    return out.reshape(x.shape)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    flat = np.ascontiguousarray(bits, dtype=np.uint16).reshape(-1)
    out = np.empty(flat.shape[0], np.float32)
    bf16_to_f32_array(flat, out)
    return out.reshape(bits.shape)
