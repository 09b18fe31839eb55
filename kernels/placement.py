"""Where packed weight streams start in memory: 16 bytes past a cache line.

The 1-token int8 kernels (kernels/simd/vnni.py: 32-byte loads walking a 4-row block) read their stream
faster from there. Measured on 2 Zen 4 cores, 1.1 GB of TinyLlama-shaped q8_0 matrices from memory at 1
token, the same bytes placed at each offset past a cache line, alternating in one process, GB/s: offsets
0 / 8 / 16 / 24 / 32 / 48 -> 34.4 / 44.2 / 44.6 / 44.3 / 39.3 / 36.0; the served weights (kernel calls alone)
26.6 from cache-line-aligned arrays against 32.5 from 16-byte-shifted copies (34.8 / 43.4 in another run);
1 thread 19.5 / 25.1. In the VM's slower memory phases every placement reads at the same (the memory's)
pace. Arrays that numpy takes from glibc's heap land anywhere mod 64 (0, 16, 32 or 48), so the packers and
the packed cache's reader (models/packed/file.py) place them here on purpose.
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
