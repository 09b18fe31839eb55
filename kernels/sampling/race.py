"""Keyed draws: a token chosen by an exponential race whose clocks are a pure function of
(seed, position, token).

Every token j of a row gets an exponential clock E_j = -log(1 - v_j), v_j uniform in (0, 1) from a
counter-based hash of (row key, j); the draw is the kept token with the largest w_j / E_j (w: the row's
unnormalized weights). P(token j wins) = w_j / sum(w), exactly (the Gumbel-max trick, written with
exponentials). The row key is splitmix64's finalizer (a bijection of 64-bit words) chained over
(seed, position); v_j is the finalizer of key + (j + 1) * golden, its top 53 bits as a double.

Why a race and not one uniform through an inverse CDF: two models that share the clocks pick the same token
with probability at least (1 - TV) / (1 + TV) of their two distributions, whatever the token order, so a
draft model racing with the target's clocks guesses the target's own draw
(scheduling/sampling/step_sampler.py). One uniform through an inverse CDF in token-id order couples them
badly: small differences anywhere before a token shift its interval.

Cost: a row with a filtered vocabulary (top-k / top-p) races its few kept tokens; a full row is screened
without logarithms: token j can beat a clock b only if v_j * b < w_j (as E_j >= v_j), so one pass of
hashes and compares, started from the heaviest token's score, leaves a few candidates for exact scores.
"""

import numpy as np
from numba import njit

_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_TO_UNIT = 1.0 / 9007199254740992.0  # 2**-53


@njit(cache=True, nogil=True, inline="always")
def _mix64(z):
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True)
def fill_row_keys(seeds, positions, out):
    """out[i] = the key of the draw for the token at positions[i] of a request seeded seeds[i].
    seeds: [N] uint64; positions: [N] int64; out: [N] uint64."""
    for i in range(out.shape[0]):
        out[i] = _mix64(_mix64(seeds[i] + _GOLDEN) ^ np.uint64(positions[i]))


@njit(cache=True, nogil=True, inline="always")
def _uniform(key, j):
    """v in (0, 1): never 0, so a clock is never infinite; never 1, so never 0."""
    h = _mix64(key + np.uint64(j + 1) * _GOLDEN)
    return (np.float64(h >> np.uint64(11)) + 0.5) * _TO_UNIT


@njit(cache=True, nogil=True, inline="always")
def _score(w, key, j):
    return w / -np.log1p(-_uniform(key, j))


@njit(cache=True, nogil=True)
def race_kept(w, idx, n, key):
    """The winner among the kept tokens idx[:n] (weights w[idx[i]] > 0)."""
    best, best_score = idx[0], -1.0
    for i in range(n):
        s = _score(w[idx[i]], key, idx[i])
        if s > best_score:
            best, best_score = idx[i], s
    return best


@njit(cache=True, nogil=True)
def race_all(w, key, candidates):
    """The winner among every token with w[j] > 0. w: [V] f64; candidates: [V] int64 scratch."""
    top = np.argmax(w)
    bound = _score(w[top], key, top)
    n = 0
    for j in range(w.shape[0]):  # branch-free screen: candidates[n] is overwritten until a hit moves n on
        candidates[n] = j
        n += _uniform(key, j) * bound < w[j]
    best, best_score = top, bound
    for i in range(n):
        j = candidates[i]
        s = _score(w[j], key, j)
        if s > best_score:
            best, best_score = j, s
    return best
