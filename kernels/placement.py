"""Where packed weight streams start in memory: 16 bytes past a cache line.

The 1-token int8 kernels (kernels/simd/vnni.py: 32-byte loads walking a 4-row block) read their stream faster
from there than from a cache line's start or its second half (benchmarks/results/HISTORY.md). Arrays that
numpy takes from glibc's heap land anywhere mod 64 (0, 16, 32 or 48), so the packers and the packed cache's
reader (models/packed/file.py) place them here on purpose.
"""

import numpy as np

LINE = 64
STREAM_OFFSET = 16


def stream_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array starting STREAM_OFFSET bytes past a cache line."""
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + 2 * LINE, np.uint8)
    start = (STREAM_OFFSET - raw.ctypes.data) % LINE
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def stream_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    out = stream_empty(shape, dtype)
    out.fill(0)
    return out
