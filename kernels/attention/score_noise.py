"""Scores against 4-bit key rows, debiased for the rows' rounding noise.

A key row stored as codes and a scale s errs by e, and moves a score by softmax_scale * q . e. The errors of
a row's coordinates are near-independent with a mean square of kappa s^2 each (kappa: the format's, below),
so the score's noise has variance about v = softmax_scale^2 |q|^2 kappa s^2. The softmax weighs exp(score),
and the mean of exp(score + noise) is exp(score + v / 2) (the log-normal mean): rows with a larger scale draw
more weight than their keys earn, the more so the longer the context. Each score is lowered by v / 2
(score_bias, debias). Values' errors enter the output linearly: no correction. The 8-bit formats' noise is
hundreds of times smaller (int8's step is max|x| / 127, not / 7): not corrected (their scores keep their
bits).

kappa per format, the mean squared error of a coordinate over its row's squared scale:
- int4 (uniform -7..7 at s = max|x| / 7, round to nearest): the largest coordinate is exact and the others
  err uniformly within half a step, (D - 1) / (12 D);
- int4_hadamard (kernels/attention/gauss4.py's Gaussian levels, fitted scale): 0.0084, measured over rows of
  standard normal values (0.0084 at D = 32 to 128, 0.0086 at 256; the rotation makes any row's coordinates
  near-Gaussian).
tests/memory/test_kv_formats.py measures both. Measured on the demo model: benchmarks/results/HISTORY.md.
"""

import numpy as np
from numba import njit

from kernels.attention.gauss4 import GAUSS4

GAUSS4_KAPPA = np.float32(0.0084)


@njit(inline="always", nogil=True)
def row_kappa(row_elements, row_code, head_dim):
    # a key cache's kappa from its row elements and row code (kernels/attention/chunks.load_row's rule for
    # which codes a cache holds: a row code alone is ambiguous, fp8_e4m3's 3 mantissa bits are GAUSS4's 3);
    # 0: its scores are not corrected
    if 2 * row_elements != head_dim:  # one code a value (or none): 8 bits or wider
        return np.float32(0.0)
    if row_code == GAUSS4:
        return GAUSS4_KAPPA
    return np.float32(head_dim - 1) / np.float32(12 * head_dim)  # uniform int4


@njit(inline="always", nogil=True)
def score_bias(qg, softmax_scale, kappa, bias):
    # qg [group, D] -> bias [group]: half the variance of head g's score noise per unit of a key row's squared
    # scale, 0.5 softmax_scale^2 |q_g|^2 kappa
    for g in range(qg.shape[0]):
        norm = np.float32(0.0)
        for d in range(qg.shape[1]):
            norm += qg[g, d] * qg[g, d]
        bias[g] = np.float32(0.5) * np.float32(softmax_scale) * np.float32(softmax_scale) * kappa * norm


@njit(inline="always", nogil=True)
def debias(scores, bias, scale2, a, b):
    # scores [group, >= b]; bias [group] (score_bias); scale2 [>= b]: each key's squared row scale (0 for a
    # row read unquantized) -> scores[g, j] -= bias[g] * scale2[j] for j in a .. b
    for g in range(scores.shape[0]):
        for j in range(a, b):
            scores[g, j] -= bias[g] * scale2[j]
