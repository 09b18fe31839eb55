"""numba kernels: pure functions over preallocated arrays. No state, no classes."""

import os

# numba's OpenMP layer (libgomp) reads this once, when it loads. Spinning waiters cost ~6 ms per
# parallel region whenever another process shares a core (measured: 60-140 ms vs 0.4 ms per decode
# step of a tiny model); sleeping waiters cost microseconds. Set it to ACTIVE on dedicated cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
