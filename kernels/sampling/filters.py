"""Sampling kernels: temperature / top-k / top-p / min-p over rows of logits, then the keyed race.

Filters follow scheduling/sampling/sampler.py's reference semantics (`sampling_probs`), computed in float64:
top_k keeps tokens whose logit is >= the k-th largest (ties kept), top_p the smallest prefix of tokens
by descending probability (stable: lower ids first among ties) whose mass reaches top_p, min_p the
tokens with probability >= min_p * the top probability. The draw is kernels/sampling/race.py's keyed race.

Per row: one vectorized pass computes w = exp(x / T - max) (our own exp, so LLVM vectorizes it without
SVML); top-k bisects a logit threshold with vectorized counts, then quickselects among the tokens above
it; top-p bisects a weight threshold whose mass above reaches top_p with vectorized masked sums, then
sorts only the tokens above it (a few hundred, not V).
"""

import numpy as np
from numba import njit

from kernels.formats.bits import as_float, as_int
from kernels.sampling.race import race_all, race_kept

_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SHIFT = 6755399441055744.0  # 1.5 * 2**52: adding it rounds to an integer held in the low mantissa bits
_SHIFT_BITS = np.int64(np.array([_SHIFT]).view(np.int64)[0])
_EXP_MIN = -708.0  # below this exp(s) would be subnormal: taken as 0
# the bisected threshold keeps this much extra mass, so rounding never cuts the nucleus short
_TOP_P_MARGIN = 1e-9


@njit(cache=True, nogil=True, fastmath={"contract", "reassoc"})
def _sum(w):
    total = 0.0
    for j in range(w.shape[0]):
        total += w[j]
    return total


@njit(cache=True, nogil=True, fastmath={"contract"})  # no reassoc: it could undo the two-part ln2 reduction
def _exp_weights(x, temperature, w):
    """w[j] = exp(x[j] / T - max(x) / T) in float64 (relative error < 5e-16; 0 below exp(-708)).
    -> (max(x) / T, sum of w). x: [V] f32; w: [V] f64 out.

    exp(s) = 2**n exp(r), s = n ln2 + r, |r| <= ln2/2: exp(r) by its Taylor polynomial of degree 12,
    2**n written into the exponent bits. Branch-free, so LLVM vectorizes it (numba's math.exp is scalar)."""
    xmax = np.float64(x[0])
    for j in range(1, x.shape[0]):
        xmax = max(xmax, np.float64(x[j]))
    m = xmax / temperature
    for j in range(x.shape[0]):
        s = np.float64(x[j]) / temperature - m
        keep = s >= _EXP_MIN  # also False for -inf and nan
        s = s if keep else 0.0
        k = s * _LOG2E + _SHIFT
        n = k - _SHIFT
        r = s - n * _LN2_HI - n * _LN2_LO
        p = 1.0 / 479001600.0
        p = p * r + 1.0 / 39916800.0
        p = p * r + 1.0 / 3628800.0
        p = p * r + 1.0 / 362880.0
        p = p * r + 1.0 / 40320.0
        p = p * r + 1.0 / 5040.0
        p = p * r + 1.0 / 720.0
        p = p * r + 1.0 / 120.0
        p = p * r + 1.0 / 24.0
        p = p * r + 1.0 / 6.0
        p = p * r + 0.5
        p = p * r + 1.0
        p = p * r + 1.0
        two_n = as_float((as_int(k) - _SHIFT_BITS + 1023) << 52)
        w[j] = p * two_n if keep else 0.0
    return m, _sum(w)


@njit(cache=True, nogil=True, fastmath={"contract", "reassoc"})
def _mass_above(w, threshold):
    total = 0.0
    for j in range(w.shape[0]):
        total += w[j] if w[j] >= threshold else 0.0
    return total


@njit(cache=True, nogil=True)
def _gather(values, threshold, idx):
    """idx[:n] = the j (ascending) with values[j] >= threshold; -> n."""
    n = 0
    for j in range(values.shape[0]):  # branch-free: idx[n] is overwritten until a hit moves n on
        idx[n] = j
        n += values[j] >= threshold
    return n


@njit(cache=True, nogil=True)
def _top_p_candidates(w, total, top_p, idx):
    """idx[:n] = the ids (ascending) with w >= t, for a t whose mass above reaches top_p * total with a
    margin, so they hold the nucleus; -> n. Bisects log2(t) by vectorized masked sums, starting from
    t = (total - need) / 2V: the mass below t is < V t, so the mass above it is safely >= need."""
    V = w.shape[0]
    need = top_p * total * (1.0 + _TOP_P_MARGIN)
    lo = np.log2(0.5 * (total - need) / V) if need < total else -np.inf
    if not lo >= -64.0:
        return _gather(w, 0.0, idx)  # top_p within a rounding of 1: every token
    hi = 0.0
    if _mass_above(w, 1.0) >= need:
        lo = 0.0
    while hi - lo > 0.125:
        mid = 0.5 * (lo + hi)
        if _mass_above(w, 2.0 ** mid) >= need:
            lo = mid
        else:
            hi = mid
    return _gather(w, 2.0 ** lo, idx)


@njit(cache=True, nogil=True)
def _top_p_cut(w, idx, n, total, top_p):
    """Keep the smallest prefix of idx[:n] (ascending ids) by descending w (stable) whose probability
    reaches top_p, compacted in place, ascending; -> (its length, whether it reached top_p). The
    reference's arithmetic: a token is dropped when the cumulative probability before it is >= top_p."""
    order = np.argsort(-w[idx[:n]], kind="mergesort")
    cumulative = 0.0
    keep = np.zeros(n, np.bool_)
    for r in range(n):
        p = w[idx[order[r]]] / total
        cumulative += p
        if cumulative - p >= top_p:
            break
        keep[order[r]] = True
    m = 0
    for i in range(n):
        if keep[i]:
            idx[m] = idx[i]
            m += 1
    return m, cumulative >= top_p


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _count_above(x, threshold):
    count = 0
    for j in range(x.shape[0]):
        count += 1 if x[j] >= threshold else 0
    return count


@njit(cache=True, nogil=True)
def _top_k(x, k, idx):
    """idx[:n] = the ids (ascending) whose logit is >= the k-th largest (ties kept); -> n, or -1 when that
    is every token. Bisects a value threshold by vectorized counts, then selects among the tokens above it."""
    lo, hi = np.inf, -np.inf
    for j in range(x.shape[0]):
        if x[j] > -np.inf:
            lo = min(lo, x[j])
            hi = max(hi, x[j])
    if _count_above(x, lo) <= k:  # -inf logits rank last: every finite one is in
        return -1
    for _ in range(32):  # count(x >= lo) > k > count(x >= hi) throughout
        mid = lo + 0.5 * (hi - lo)
        if not lo < mid < hi:
            break
        count = _count_above(x, mid)
        if count >= k:
            lo = mid
            if count <= 2 * k + 64:
                break
        else:
            hi = mid
    n = _gather(x, lo, idx)
    values = x[idx[:n]]
    kth = np.partition(values, n - k)[n - k]
    return _gather_ids(x, kth, idx, n)


@njit(cache=True, nogil=True)
def _gather_ids(values, threshold, idx, n):
    """Compact idx[:n] in place to the ids with values[id] >= threshold; -> their number."""
    m = 0
    for i in range(n):
        if values[idx[i]] >= threshold:
            idx[m] = idx[i]
            m += 1
    return m


@njit(cache=True, nogil=True)
def _filter_row(x, temperature, top_k, top_p, min_p, w, idx):
    """The kept tokens of one row and their weights: -> (n, total). n = -1: every token with w[j] > 0 is
    kept (weights in w, dropped ones zeroed); else idx[:n] (ascending) are kept, w valid there.
    total: the kept weight. x: [V] f32; w: [V] f64; idx: [V] int64."""
    V = x.shape[0]
    total = _exp_weights(x, temperature, w)[1]
    n = -1
    if 0 < top_k < V:
        n = _top_k(x, top_k, idx)
    if n >= 0:
        total = 0.0
        for i in range(n):
            total += w[idx[i]]
    if top_p < 1.0:
        if n < 0:
            n, reached = _top_p_cut(w, idx, _top_p_candidates(w, total, top_p, idx), total, top_p)
            # rounding hid part of the nucleus below the threshold: take every token
            if not reached and n < V:
                n = _top_p_cut(w, idx, _gather(w, 0.0, idx), total, top_p)[0]
        else:
            n = _top_p_cut(w, idx, n, total, top_p)[0]
    if min_p > 0.0:
        # the top token has w = exp(0) = 1, so probability >= min_p * top probability is w >= min_p
        if n < 0:
            for j in range(V):
                if w[j] < min_p:
                    w[j] = 0.0
        else:
            m = 0
            for i in range(n):
                if w[idx[i]] >= min_p:
                    idx[m] = idx[i]
                    m += 1
            n = m
    if n >= 0 or min_p > 0.0:
        total = 0.0
        if n < 0:
            total = _sum(w)
        else:
            for i in range(n):
                total += w[idx[i]]
    return n, total


@njit(cache=True, nogil=True)
def sample_filtered(logits, temperature, top_k, top_p, min_p, keys, out):
    """out[i] = the token row i's filtered distribution draws in the race keyed by keys[i]
    (kernels/sampling/race.py).

    logits: [N, V] f32 (penalties applied); temperature, top_p, min_p: [N] f64; top_k: [N] int64;
    keys: [N] uint64; out: [N] int64."""
    V = logits.shape[1]
    w = np.empty(V)
    idx = np.empty(V, np.int64)
    for i in range(logits.shape[0]):
        n = _filter_row(logits[i], temperature[i], top_k[i], top_p[i], min_p[i], w, idx)[0]
        out[i] = race_all(w, keys[i], idx) if n < 0 else race_kept(w, idx, n, keys[i])


@njit(cache=True, nogil=True)
def log_normalizers(logits, out):
    """out[i] = log(sum(exp(logits[i]))) in float64 (the log-softmax of row i is logits[i] - out[i]).
    logits: [N, V] f32; out: [N] f64."""
    V = logits.shape[1]
    w = np.empty(V)
    for i in range(logits.shape[0]):
        m, total = _exp_weights(logits[i], 1.0, w)
        out[i] = m + np.log(total)
