"""Give freed heap memory back to the OS.

Repacking weights at load time (models/quantization/activation_plan.py) frees the original matrices, but glibc
keeps freed chunks in its heap: the process stays about their size above its weights until `malloc_trim`
returns them.

Buffers that start as zeros and may stay unused (LoRA slots, the KV pool) come from their own anonymous
mapping: `np.zeros` of a size glibc serves from its heap (below its mmap threshold, which freeing the load's
temporaries raises to 32 MB) reuses the freed chunks and writes their zeros, so the whole buffer is resident
at once.
"""

import ctypes
import ctypes.util
import mmap

import numpy as np


def release_free_heap() -> bool:
    """-> whether the C library could trim (False where it is not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError, TypeError):
        return False
    trim(0)  # returns whether memory was released; either way the heap is now trimmed
    return True


def untouched_zeros(shape: tuple[int, ...], dtype) -> np.ndarray:
    """A zeroed array whose pages take memory only once written (an anonymous mapping of its own, unmapped
    when the array is freed; transparent huge pages asked for, so memory is taken in steps of up to 2 MB)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize == 0:
        return np.zeros(shape, dtype)
    buffer = mmap.mmap(-1, count * dtype.itemsize)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # as numpy asks for its large arrays (fewer TLB misses in the KV reads)
        buffer.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(buffer, dtype, count).reshape(shape)
