"""The machine's own limits, measured in the same run: memory read bandwidth and float32 matmul rate."""

import time

import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, parallel=True, fastmath=True)
def _read_all(a):
    # a: [R, 4096] f32; a vectorized sum touches every byte once
    total = 0.0
    for r in prange(a.shape[0]):
        s = np.float32(0.0)
        for k in range(a.shape[1]):
            s += a[r, k]
        total += s
    return total


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Best-of read bandwidth in bytes/s over an array much larger than the caches."""
    a = np.ones((nbytes // 16384, 4096), np.float32)
    _read_all(a)
    best = min(_timed(lambda: _read_all(a)) for _ in range(repeats))
    return a.nbytes / best


def matmul_flops(m: int = 512, k: int = 2048, n: int = 2048, repeats: int = 5) -> float:
    """Best-of numpy float32 matmul rate in FLOP/s."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((m, k), dtype=np.float32), rng.standard_normal((n, k), dtype=np.float32)
    x @ w.T
    return 2 * m * k * n / min(_timed(lambda: x @ w.T) for _ in range(repeats))


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
