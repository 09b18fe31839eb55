"""FP8 (OCP e4m3fn and e5m2) codes as uint8: round-to-nearest-even encoding and a decoding table.

e4m3fn: 4 exponent bits (bias 7), 3 mantissa bits, no infinities, 0x7F / 0xFF are NaN, largest 448.
e5m2: 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (infinities, NaNs), largest 57344.
Encoding saturates at the largest finite value (torch's cast gives NaN or inf there); the KV writers scale
each row so that its largest magnitude maps to that value, so saturation only absorbs the last rounding.
"""

import math

import numpy as np
from numba import njit

# (mantissa bits, exponent bias, largest finite code) of each format
E4M3 = (3, 7, 0x7E)
E5M2 = (2, 15, 0x7B)


def decode_table(man_bits: int, bias: int, max_code: int) -> np.ndarray:
    """float32 [256]: the value of every code (NaN and inf where the format has them)."""
    exp_bits = 7 - man_bits
    table = np.empty(256, np.float32)
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e, m = (code >> man_bits) & ((1 << exp_bits) - 1), code & ((1 << man_bits) - 1)
        if (code & 0x7F) > max_code:  # past the largest finite value: e5m2's inf, then NaNs; e4m3fn's NaN
            table[code] = sign * math.inf if (man_bits == 2 and m == 0) else math.nan
        elif e == 0:  # subnormal
            table[code] = sign * math.ldexp(m, 1 - bias - man_bits)
        else:
            table[code] = sign * math.ldexp((1 << man_bits) + m, e - bias - man_bits)
    return table


E4M3_TABLE = decode_table(*E4M3)
E5M2_TABLE = decode_table(*E5M2)


@njit(inline="always", nogil=True)
def fp8_max(man_bits, bias, max_code):
    return math.ldexp(float((1 << man_bits) + (max_code & ((1 << man_bits) - 1))),
                      (max_code >> man_bits) - bias - man_bits)


@njit(inline="always", nogil=True)
def fp8_encode(x, man_bits, bias, max_code):
    # x: float32 -> uint8 code, nearest value (ties to even mantissa), saturating; in float64 every step
    # is exact: a / quantum scales by a power of two, rint rounds half to even
    sign = 0x80 if x < 0 else 0
    a = abs(float(x))
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
