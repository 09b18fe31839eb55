"""FP8 (OCP e4m3fn and e5m2) codes as uint8: round-to-nearest-even encoding and exact decoding.

e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7F / 0xFF are NaN, largest 448.
e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs), largest 57344.
Encoding saturates at the largest finite value (torch 2.13's e4m3fn cast does too; its e5m2 cast gives inf
from 61440 on); the KV writers scale each row so that its largest magnitude maps to that value, so saturation
only absorbs the last rounding.
"""

import math

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

# (mantissa bits, exponent bias, largest finite code) of each format
E4M3 = (3, 7, 0x7E)
E5M2 = (2, 15, 0x7B)  # the bias is 2^(exponent bits - 1) - 1: fp8_decode derives it from the mantissa bits


@njit(inline="always", nogil=True)
def fp8_decode(code, man_bits):
    # uint8 code -> float32 value, exact for every finite code (the codes past the largest finite one, never
    # written, decode to finite values)
    shift, mask = fp8_placement(man_bits)
    return fp8_as_f32(code, shift, mask) * fp8_unbias(man_bits)


@njit(inline="always", nogil=True)
def fp8_placement(man_bits):
    # fp8_as_f32's (shift, mask) for a format: its mantissa's top bit lands on float32's bit 22, its exponent
    # on the low bits of float32's; the mask keeps those and the sign
    shift = 23 - man_bits
    return shift, -(1 << 31) | (0x7F << shift)


@intrinsic
def fp8_as_f32(typingctx, code, shift, mask):
    """A uint8 code's sign, exponent and mantissa bits placed in a float32's (fp8_placement's shift and mask):
    the code's value times 2^(bias - 127), subnormals included (as float32 subnormals). The code is read sign
    extended (free in the load), then one shift and one and, all in 32-bit lanes: decode attention reading a
    256-entry table instead was slower."""
    if code != types.uint8 or not isinstance(shift, types.Integer) or not isinstance(mask, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        narrow = [builder.trunc(a, i32) if t.bitwidth > 32 else a
                  for a, t in zip(args[1:], signature.args[1:])]
        bits = builder.shl(builder.sext(args[0], i32), narrow[0])
        return builder.bitcast(builder.and_(bits, narrow[1]), ir.FloatType())

    return types.float32(code, shift, mask), codegen


@njit(inline="always", nogil=True)
def fp8_unbias(man_bits):
    # 2^(127 - bias), bias = 2^(exponent bits - 1) - 1 (7 for e4m3fn, 15 for e5m2); once a row, not a value
    return np.float32(2.0 ** (127 - ((1 << (6 - man_bits)) - 1)))


@njit(inline="always", nogil=True)
def fp8_row_factor(man_bits, scale):
    # fp8_unbias(man_bits) * scale as one factor when that product is exact (a float32 times a power of two
    # is, short of overflow: scale below 2^(1 + bias)), else 0: then multiply by the two in turn
    unbias = fp8_unbias(man_bits)
    return unbias * scale if scale < np.float32(2.0 ** (1 + (1 << (6 - man_bits)) - 1)) else np.float32(0.0)


@njit(inline="always", nogil=True)
def fp8_max(man_bits, bias, max_code):
    return math.ldexp(float((1 << man_bits) + (max_code & ((1 << man_bits) - 1))),
                      (max_code >> man_bits) - bias - man_bits)


@njit(inline="always", nogil=True)
def fp8_encode(x, man_bits, bias, max_code):
    # x: float32 -> uint8 code, nearest value (ties to even mantissa), saturating; in float64 every step
    # is exact: a / quantum scales by a power of two, rint rounds half to even. -0.0 keeps its sign and NaN
    # becomes the NaN code 0x7F (both formats) with x's sign, as torch's casts do: all 2^32 float32 bit
    # patterns give torch's codes (past the largest finite value: torch's e4m3fn saturates as we do)
    sign = 0x80 if math.copysign(1.0, x) < 0 else 0
    a = abs(float(x))
    if math.isnan(a):
        return np.uint8(sign | 0x7F)
    if a == 0.0:
        return np.uint8(sign)
    emin = 1 - bias
    e = max(math.frexp(a)[1] - 1, emin)  # a's binary exponent, no less than the smallest normal's
    v = np.rint(a / math.ldexp(1.0, e - man_bits)) * math.ldexp(1.0, e - man_bits)
    if v > fp8_max(man_bits, bias, max_code):
        return np.uint8(sign | max_code)
    if v == 0.0:
        return np.uint8(sign)
    e = max(math.frexp(v)[1] - 1, emin)  # rounding may have carried into the next binade
    mantissa = int(v / math.ldexp(1.0, e - man_bits))  # (1 << man_bits) + m for normals, m for subnormals
    if mantissa < (1 << man_bits):
        return np.uint8(sign | mantissa)
    return np.uint8(sign | ((e + bias) << man_bits) | (mantissa - (1 << man_bits)))
