"""FP8 (OCP e4m3fn and e5m2) codes as uint8: round-to-nearest-even encoding and exact decoding.

e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7F / 0xFF are NaN, largest 448.
e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs), largest 57344.
Encoding saturates at the largest finite value (torch 2.13's e4m3fn cast does too; its e5m2 cast gives inf
from 61440 on); the KV writers scale each row so that its largest magnitude maps to that value, so saturation
only absorbs the last rounding.
"""

import math

import numpy as np
from numba import njit

from kernels.bf16 import bf16_to_f32

# (mantissa bits, exponent bias, largest finite code) of each format
E4M3 = (3, 7, 0x7E)
E5M2 = (2, 15, 0x7B)  # the bias is 2^(exponent bits - 1) - 1: fp8_decode derives it from the mantissa bits


@njit(inline="always", nogil=True)
def fp8_decode(code, man_bits):
    # uint8 code -> float32 value, exact for every finite code (the codes past the largest finite one, never
    # written, decode to finite values)
    return fp8_as_bf16(code, man_bits) * fp8_unbias(man_bits)


@njit(inline="always", nogil=True)
def fp8_as_bf16(code, man_bits):
    # the code's exponent and mantissa bits placed in a bfloat16's (8 exponent bits): the code's value times
    # 2^(bias - 127), subnormals included. Shifts that vectorize: decode attention over 4096 positions (32 / 4
    # heads, head_dim 64) took 2x bf16's time reading a 256-entry table, about bf16's time this way (noisy)
    return bf16_to_f32(((np.int32(code) & 0x80) << 8) | ((np.int32(code) & 0x7F) << (7 - man_bits)))


@njit(inline="always", nogil=True)
def fp8_unbias(man_bits):
    # 2^(127 - bias), bias = 2^(exponent bits - 1) - 1 (7 for e4m3fn, 15 for e5m2); once a row, not a value
    return np.float32(2.0 ** (127 - ((1 << (6 - man_bits)) - 1)))


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
