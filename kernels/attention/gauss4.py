"""The rotated 4-bit KV rows' codebook (int4_hadamard): 16 levels placed for a standard normal coordinate, and
the per-row fit of its one scale.

A row rotated by the normalized Hadamard transform (kernels/attention/hadamard.py) has coordinates that are
sums of all D with mixed signs: near-Gaussian whatever the model's channels look like. Its codes can then sit
where a Gaussian's mass is rather than evenly from -max|x| to max|x|: GAUSS4_LEVELS is Max's 16-level
minimum-error quantizer of N(0, 1) (J. Max, "Quantizing for minimum distortion", 1960; Lloyd's algorithm gives
the same), symmetric, no zero level. Unrotated rows keep the uniform grid (kernels/attention/kv_quant.py's
int4): their distribution is the model's.

A row x [D] is stored as codes c (indices into GAUSS4_LEVELS, two a byte, the even coordinate in the low
nibble) and one float32 scale s, x ~ s * GAUSS4_LEVELS[c]. The fit: for each fraction g of FIT_GRID, the
scale max|x| * g / GAUSS4_LEVELS[15] and every value's nearest level; the fraction whose codes err least (sum
of squares) is kept, and s is the least-squares scale of its codes, (x . L[c]) / (L[c] . L[c]). On rows of
standard normal values this errs 38% less than the uniform -7..7 grid at max|x| / 7 (0.0058 against 0.0095
squared a value at D = 32; the best fraction lies between 0.85 and 1.1 for 90% of rows at D = 32 to 128).
Scores against these rows are debiased for their noise: kernels/attention/score_noise.py. Measured on the
demo model: benchmarks/results/kv_quality.json and HISTORY.md.
"""

import numpy as np
from numba import njit

_HALF = np.array([0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6180, 2.0690, 2.7326], np.float32)
GAUSS4_LEVELS = np.concatenate([-_HALF[::-1], _HALF])  # [16] f32, ascending: code i is level i
_MIDPOINTS = ((GAUSS4_LEVELS[1:] + GAUSS4_LEVELS[:-1]) / np.float32(2.0)).astype(np.float32)  # [15]
_TOP = GAUSS4_LEVELS[15]
FIT_GRID = (np.float32(0.8) + np.float32(0.025) * np.arange(13, dtype=np.float32)).astype(np.float32)
# the row code of these rows: write_kv_scaled's (kernels/attention/kv_quant.py: INT8 0, INT4 1, FP8 2), and
# load_row's for a two-codes-a-byte cache (0 there: the uniform int4 codes n - 8)
GAUSS4 = 3


@njit(inline="always", nogil=True)
def nearest_code(y):
    # the index of y's nearest level (ties to the lower one): how many midpoints lie below y
    c = 0
    for m in range(_MIDPOINTS.shape[0]):
        c += y > _MIDPOINTS[m]
    return c


@njit(inline="always", nogil=True)
def gauss4_row(x, dst):
    # x: [D] f32 -> codes into dst [D // 2] uint8 -> the row's scale (0 for an all-zero row)
    amax = np.float32(0.0)
    for d in range(x.shape[0]):
        amax = max(amax, abs(x[d]))
    if amax == 0:
        for i in range(dst.shape[0]):
            dst[i] = np.uint8(0x88)
        return np.float32(0.0)
    best_g, best_err = FIT_GRID[0], np.float32(np.inf)
    for g in FIT_GRID:
        s = amax * g / _TOP
        inv = np.float32(1.0) / s
        err = np.float32(0.0)
        for d in range(x.shape[0]):
            e = x[d] - s * GAUSS4_LEVELS[nearest_code(x[d] * inv)]
            err += e * e
        if err < best_err:
            best_g, best_err = g, err
    inv = np.float32(1.0) / (amax * best_g / _TOP)
    num, den = np.float32(0.0), np.float32(0.0)
    for i in range(dst.shape[0]):
        lo, hi = nearest_code(x[2 * i] * inv), nearest_code(x[2 * i + 1] * inv)
        num += x[2 * i] * GAUSS4_LEVELS[lo] + x[2 * i + 1] * GAUSS4_LEVELS[hi]
        den += GAUSS4_LEVELS[lo] * GAUSS4_LEVELS[lo] + GAUSS4_LEVELS[hi] * GAUSS4_LEVELS[hi]
        dst[i] = np.uint8(lo | (hi << 4))
    return num / den
