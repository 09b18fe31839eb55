"""exp32(x): float32 exp that LLVM vectorizes (numba's math.exp / np.exp call the scalar libm expf: the
softmax of attention and SiLU waited on it one value at a time).

exp(x) = 2**n exp(r), x = n ln2 + r, |r| <= ln2/2 (ln2 in two parts, Cody and Waite); exp(r) by Cephes' expf
polynomial (relative error ~1 ulp: tests/kernels/test_exp32.py bounds it against float64); 2**n written into
the exponent bits. Branch-free. x is clamped to [-87, 88], where 2**n stays a normal float: exp(x) for x below
-87 is 0, above 88 exp(88) (the callers' arguments are <= 0 (softmax) or make the result vanish (SiLU)).
Inlined with its caller's fastmath flags, which must leave out "reassoc" (it could undo the two-part
reduction); the kernels here use contract, nnan, ninf, nsz, afn, arcp.
"""

import numpy as np
from numba import njit

from kernels.formats.bits import as_float, as_int

_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # exact in 10 bits: n * _LN2_HI is exact for |n| <= 128
_LN2_LO = np.float32(-2.12194440e-4)
_SHIFT = np.float32(12582912.0)  # 1.5 * 2**23: adding it rounds to an integer held in the low mantissa bits
_SHIFT_BITS = np.int32(np.array([_SHIFT]).view(np.int32)[0])
_X_MIN, _X_MAX = np.float32(-87.0), np.float32(88.0)


@njit(inline="always", nogil=True)
def exp32(x):
    """exp(x) for a float32 x (see the module docstring for its range)."""
    keep = x >= _X_MIN
    s = min(max(x, _X_MIN), _X_MAX)
    k = s * _LOG2E + _SHIFT
    n = k - _SHIFT
    r = s - n * _LN2_HI
    r = r - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = p * (r * r) + r + np.float32(1.0)
    two_n = as_float(np.int32((as_int(k) - _SHIFT_BITS + np.int32(127)) << np.int32(23)))
    return y * two_n if keep else np.float32(0.0)


@njit(inline="always", nogil=True)
def tanh32(x):
    """tanh(x) for a float32 x, as 1 - 2 / (exp(2x) + 1): vectorizes with exp32 (absolute error ~1e-7; near 0
    the subtraction loses tanh's relative precision, which its callers (soft-capping, GELU) do not need)."""
    return np.float32(1.0) - np.float32(2.0) / (exp32(np.float32(2.0) * x) + np.float32(1.0))


@njit(cache=True, nogil=True, error_model="numpy")
def softcap_inplace(x, cap):
    # x: [R, N] f32 -> cap * tanh(x / cap) (Gemma 2's final logits)
    c = np.float32(cap)
    inv = np.float32(1.0) / c
    for r in range(x.shape[0]):
        for n in range(x.shape[1]):
            x[r, n] = c * tanh32(x[r, n] * inv)
