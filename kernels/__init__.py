"""numba kernels: pure functions over preallocated arrays. No state, no classes."""
