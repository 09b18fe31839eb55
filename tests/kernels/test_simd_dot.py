"""kernels/simd/dot.py: dots() gives every row dot()'s bits (attention's scores, whichever way they are
computed)."""

import numpy as np
import pytest
from numba import njit

from kernels.simd.dot import dot, dots


@njit
def one_at_a_time(a, b, out, column, scale):
    for g in range(a.shape[0]):
        out[g, column] = dot(a[g], b) * scale


@njit
def together(a, b, out, column, scale):
    dots(a, b, out, column, scale)


@pytest.mark.parametrize("rows", [1, 3, 4, 7, 8, 9, 12, 16, 21])
@pytest.mark.parametrize("d", [1, 5, 8, 64, 67, 128])
def test_dots_equal_dot_row_by_row_and_touch_only_their_column(rows, d):
    rng = np.random.default_rng(rows * 1000 + d)
    a, b = rng.standard_normal((rows, d)).astype(np.float32), rng.standard_normal(d).astype(np.float32)
    expected, got = np.full((rows, 4), 7.0, np.float32), np.full((rows, 4), 7.0, np.float32)
    one_at_a_time(a, b, expected, 2, np.float32(0.125))
    together(a, b, got, 2, np.float32(0.125))
    assert np.array_equal(expected.view(np.uint32), got.view(np.uint32))
    np.testing.assert_allclose(got[:, 2], a.astype(np.float64) @ b * 0.125, rtol=1e-5, atol=1e-5)
