"""The scale searches of ggml's quantizers (ggml-quants.c: the K-quants' reference quantizers, and the
importance-weighted ones llama-quantize runs with --imatrix), in the same float32 operations in the same
order, so that the chosen integers and scales are bit-equal.

Every literal is a float32 and every int is converted before it meets a float: numba, like numpy, would
otherwise widen float32 * int64 to float64 and round differently.
"""

import numpy as np
from numba import njit

from kernels.formats.bits import as_int

GROUP_MAX_EPS = np.float32(1e-15)  # ggml's bound below which a group counts as all zero


@njit(inline="always", nogil=True)
def nearest_int(v):
    """float32 v to the nearest int32, ties to even, the way ggml does it: for |v| < 2**22, v + 1.5 * 2**23
    holds v's rounded value in its low mantissa bits (beyond that the same meaningless bits as ggml's)."""
    return np.int32((as_int(v + np.float32(12582912.0)) & 0x7FFFFF) - 0x400000)


@njit(inline="always", nogil=True)
def clamp(v, lo, hi):
    return max(lo, min(hi, v))


@njit(inline="always", nogil=True)
def fit_scale_min(x, weights, nmax, rmin, rdelta, nstep, L, trial):
    """x ~ scale * L - the_min, L integers in [0, nmax] (ggml's make_qkx2_quants, squared error).

    Starts from the range's grid (the min clamped to <= 0), then tries nstep + 1 grids of
    (nmax + rmin + rdelta * step) levels over the range, each refined by weighted least squares for scale and
    min, and keeps the one of least weighted squared error. x, weights: [n] f32; L, trial: [n] uint8
    (L out, trial scratch). Returns (scale, the_min), f32.
    """
    n = x.shape[0]
    lo, hi = x[0], x[0]
    sum_w = weights[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        lo = min(lo, x[i])
        hi = max(hi, x[i])
        sum_w += weights[i]
        sum_x += weights[i] * x[i]
    if lo > 0:
        lo = np.float32(0.0)
    if hi == lo:
        L[:] = 0
        return np.float32(0.0), -lo
    levels = np.float32(nmax)
    iscale = levels / (hi - lo)
    scale = np.float32(1.0) / iscale
    best_error = np.float32(0.0)
    for i in range(n):
        L[i] = clamp(nearest_int(iscale * (x[i] - lo)), 0, nmax)
        diff = scale * np.float32(L[i]) + lo - x[i]
        best_error += weights[i] * (diff * diff)
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * np.float32(step) + levels) / (hi - lo)
        sum_l, sum_l2, sum_xl = np.float32(0.0), np.float32(0.0), np.float32(0.0)
        for i in range(n):
            q = clamp(nearest_int(iscale * (x[i] - lo)), 0, nmax)
            trial[i] = q
            wq = weights[i] * np.float32(q)
            sum_l += wq
            sum_l2 += wq * np.float32(q)
            sum_xl += wq * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = np.float32(0.0)
                this_scale = sum_xl / sum_l2
            error = np.float32(0.0)
            for i in range(n):
                diff = this_scale * np.float32(trial[i]) + this_min - x[i]
                error += weights[i] * (diff * diff)
            if error < best_error:
                L[:] = trial
                best_error = error
                scale = this_scale
                lo = this_min
    return scale, -lo


@njit(inline="always", nogil=True)
def fit_signed_scale(x, weights, nmax, L):
    """x ~ scale * (L - nmax), L in [0, 2 nmax) (ggml's make_qx_quants, rmse_type 1: weights x**2 without an
    importance matrix, its weights with one).

    The grid puts -nmax on the value of largest magnitude; 18 grids of nmax +- 0.1 .. 0.9 levels are tried,
    each scored by its weighted least-squares fit sum(w x l)**2 / sum(w l**2), and the best one's
    least-squares scale returned. x, weights: [n] f32; L: [n] int8 (out). An all-zero group gives L = 0 and
    scale 0.
    """
    n = x.shape[0]
    amax, xmax = np.float32(0.0), np.float32(0.0)
    for i in range(n):
        if abs(x[i]) > amax:
            amax, xmax = abs(x[i]), x[i]
    if amax < GROUP_MAX_EPS:
        L[:] = 0
        return np.float32(0.0)
    levels = np.float32(nmax)
    scale, best = _score_signed_grid(x, weights, -levels / xmax, nmax, L)
    for step in range(-9, 10):
        if step != 0:
            iscale = -(levels + np.float32(0.1) * np.float32(step)) / xmax
            sumlx, suml2 = _signed_sums(x, weights, iscale, nmax)
            if suml2 > 0 and sumlx * sumlx > best * suml2:
                scale, best = _score_signed_grid(x, weights, iscale, nmax, L)
    return scale


@njit(inline="always", nogil=True)
def _signed_sums(x, weights, iscale, nmax):
    sumlx, suml2 = np.float32(0.0), np.float32(0.0)
    for i in range(x.shape[0]):
        q = np.float32(clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1))
        w = weights[i]
        sumlx += w * x[i] * q
        suml2 += w * q * q
    return sumlx, suml2


@njit(inline="always", nogil=True)
def _score_signed_grid(x, weights, iscale, nmax, L):
    # the grid iscale's integers into L, and its least-squares (scale, score)
    sumlx, suml2 = _signed_sums(x, weights, iscale, nmax)
    for i in range(x.shape[0]):
        L[i] = clamp(nearest_int(iscale * x[i]), -nmax, nmax - 1) + nmax
    scale = sumlx / suml2 if suml2 != 0 else np.float32(0.0)
    return scale, scale * sumlx


@njit(inline="always", nogil=True)
def fit_positive_scale(x, weights, nmax, L):
    """x ~ scale * L, x >= 0, L in [0, nmax] (ggml's make_qp_quants: a K-quant block's sub-block scales and
    mins on 6 bits, weighted by the sub-blocks' summed importance).

    The grid puts nmax on the largest x; 8 grids of nmax +- 0.1 .. 0.4 levels are scored by weighted squared
    error, the best one's integers refined five times one at a time (each moved to its least-squares level if
    that improves the fit), and the least-squares scale returned. x, weights: [n] f32; L: [n] uint8 (out: as
    ggml's uint8, a negative level wraps). All below GROUP_MAX_EPS gives L = 0 and scale 0.
    """
    n = x.shape[0]
    top = np.float32(0.0)
    for i in range(n):
        top = max(top, x[i])
    if top < GROUP_MAX_EPS:
        L[:] = 0
        return np.float32(0.0)
    levels = np.float32(nmax)
    iscale = levels / top
    for i in range(n):
        L[i] = nearest_int(iscale * x[i]) & 255
    scale = np.float32(1.0) / iscale
    best_mse = np.float32(0.0)
    for i in range(n):
        diff = x[i] - scale * np.float32(L[i])
        best_mse += weights[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_step = (np.float32(0.1) * np.float32(step) + levels) / top
        scale_step = np.float32(1.0) / iscale_step
        mse = np.float32(0.0)
        for i in range(n):
            q = min(nmax, nearest_int(iscale_step * x[i]))
            diff = x[i] - scale_step * np.float32(q)
            mse += weights[i] * diff * diff
        if mse < best_mse:
            best_mse = mse
            iscale = iscale_step
    sumlx, suml2 = np.float32(0.0), np.float32(0.0)
    for i in range(n):
        q = min(nmax, nearest_int(iscale * x[i]))
        L[i] = q & 255
        sumlx += weights[i] * x[i] * np.float32(q)
        suml2 += weights[i] * np.float32(q) * np.float32(q)
    for _ in range(5):
        changed = 0
        for i in range(n):
            w, level = weights[i], np.float32(L[i])
            slx = sumlx - w * x[i] * level
            sl2 = suml2 - w * level * level
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nearest_int(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w * x[i] * np.float32(new_l)
                    sl2 += w * np.float32(new_l) * np.float32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 255
                        sumlx, suml2 = slx, sl2
                        changed += 1
        if changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else np.float32(0.0)
