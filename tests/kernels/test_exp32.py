"""kernels/exp32.py against float64 exp, and the kernels that use it against their float64 formulas."""

import numpy as np
from numba import njit

from kernels.exp32 import exp32
from kernels.norms import silu_mul

FASTMATH = {"contract", "nnan", "ninf", "nsz", "afn", "arcp"}  # the attention kernel's flags


@njit(fastmath=FASTMATH)
def exp_all(x, out):
    for i in range(x.shape[0]):
        out[i] = exp32(x[i])


def test_exp32_is_within_an_ulp_of_exp_over_its_range_and_zero_below_it():
    x = np.concatenate([np.linspace(-87.0, 88.0, 1_000_001, dtype=np.float32),
                        np.float32([0.0, -0.0, 1e-30, -1e-30, -87.0, 88.0]),
                        np.random.default_rng(0).uniform(-20, 20, 100_000).astype(np.float32)])
    out = np.empty_like(x)
    exp_all(x, out)
    exact = np.exp(x.astype(np.float64))
    ulp = np.spacing(exact.astype(np.float32)).astype(np.float64)
    assert np.max(np.abs(out - exact) / ulp) <= 1.0
    below = np.float32([-87.01, -100.0, -1e4, -3.0e38])
    exp_all(below, out[:4])
    assert not out[:4].any()


def test_silu_mul_matches_float64():
    rng = np.random.default_rng(1)
    for rows in (1, 5, 17):  # the serial and the parallel kernel
        gate_up = (rng.standard_normal((rows, 2 * 300)) * 6).astype(np.float32)
        out = np.empty((rows, 300), np.float32)
        silu_mul(gate_up, out)
        g, u = gate_up[:, :300].astype(np.float64), gate_up[:, 300:].astype(np.float64)
        np.testing.assert_allclose(out, g / (1 + np.exp(-g)) * u, rtol=2e-6, atol=1e-30)
