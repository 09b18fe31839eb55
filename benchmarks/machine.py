"""The machine's own limits, measured in the same run: memory read bandwidth, the dot-product instructions'
peak (benchmarks/peak_kernels.py) and numpy's float32 matmul rate."""

import platform
import time
from pathlib import Path

import numpy as np
from numba import njit, prange

from benchmarks.peak_kernels import DotPeak, available


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


class MachineProbe:
    """The probes, allocated (and compiled) once so the benchmarks can sample them between their own
    samples."""

    def __init__(self, nbytes: int = 1 << 30, m: int = 512, k: int = 2048, n: int = 2048):
        self.array = np.ones((nbytes // 16384, 4096), np.float32)
        rng = np.random.default_rng(0)
        self.x, self.w = (rng.standard_normal((m, k), dtype=np.float32),
                          rng.standard_normal((n, k), dtype=np.float32))
        _read_all(self.array)
        self.x @ self.w.T
        self._peaks: dict[str, list[DotPeak]] = {}

    def read_bandwidth(self, repeats: int = 1) -> float:
        """Best-of read bandwidth in bytes/s over an array much larger than the caches."""
        return self.array.nbytes / min(_timed(lambda: _read_all(self.array)) for _ in range(repeats))

    def matmul_flops(self, repeats: int = 1) -> float:
        """Best-of numpy float32 matmul rate in FLOP/s."""
        m, k = self.x.shape
        return 2 * m * k * self.w.shape[0] / min(_timed(lambda: self.x @ self.w.T) for _ in range(repeats))

    def has_peak(self, kind: str) -> bool:
        """Whether this CPU has a dot-product instruction for activations of `kind`."""
        return any(i.kind == kind for i in available())

    def dot_peak(self, kind: str) -> float:
        """Every thread's best rate, in operations/s (a multiply-add counts 2), of the dot-product
        instructions for activations of `kind` ("int8", "bf16", "f32") this CPU has: the compute limit of
        prefill and batched decode."""
        if kind not in self._peaks:
            self._peaks[kind] = [DotPeak(i) for i in available() if i.kind == kind]
        return max(loop.ops_per_s(all_threads=True) for loop in self._peaks[kind])


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cpu_name() -> str:
    """The CPU's name and generation (family, model), as /proc/cpuinfo gives them."""
    fields = {}
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return f"{fields.get('model name', platform.processor())} (family {fields.get('cpu family')}, " \
           f"model {fields.get('model')})"
