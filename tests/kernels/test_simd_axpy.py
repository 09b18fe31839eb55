"""kernels/simd_axpy.weighted_sum: out[d] += w[j] * x[j, d] over j = a .. b - 1 in order, one fused
multiply-add a term, for row lengths of whole vector blocks and with a scalar tail."""

import numpy as np
import pytest
from numba import njit

from kernels.simd.axpy import weighted_sum


@njit(cache=True)
def _weighted_sum(w, x, a, b, out):
    weighted_sum(w, x, a, b, out)


@pytest.mark.parametrize("D", [64, 96, 24, 19, 5])
def test_weighted_sum_is_an_ordered_chain_of_fused_multiply_adds(D):
    rng = np.random.default_rng(D)
    w = rng.standard_normal(40).astype(np.float32)
    x = rng.standard_normal((40, D)).astype(np.float32)
    start = rng.standard_normal(D).astype(np.float32)
    out = start.copy()
    _weighted_sum(w, x, 3, 37, out)
    ref = start.copy()
    for j in range(3, 37):  # a float32 fused multiply-add: the product exact in float64, one rounding after
        ref = (w[j].astype(np.float64) * x[j] + ref).astype(np.float32)
    np.testing.assert_array_equal(out, ref)
    unfused = start.copy()
    for j in range(3, 37):
        unfused = unfused + w[j] * x[j]
    assert not np.array_equal(out, unfused)  # the test tells fused from unfused sums
