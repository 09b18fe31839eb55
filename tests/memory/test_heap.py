"""memory/heap.py: zero buffers that cost memory only where written, after the load's repacking freed its
heap."""

import numpy as np
import psutil

from memory.heap import release_free_heap, untouched_zeros

MB = 1 << 20


def rss() -> int:
    return psutil.Process().memory_info().rss


def test_untouched_zeros_are_zeros_of_the_shape_and_writable():
    a = untouched_zeros((3, 5, 7), np.uint16)
    assert a.shape == (3, 5, 7) and a.dtype == np.uint16 and a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[1, 2, 3] = 9
    assert a.sum() == 9
    assert untouched_zeros((0, 4), np.float32).shape == (0, 4)


def test_untouched_zeros_take_memory_only_where_written_even_over_freed_heap_chunks():
    # the load's pattern: a freed 24 MB temporary raises glibc's mmap threshold, then 8 MB matrices come from
    # its heap and are freed
    temporary = np.ones(24 * MB // 4, np.float32)
    del temporary
    freed = [np.ones(8 * MB // 4, np.float32) for _ in range(32)]
    pin = np.ones(MB // 4, np.float32)  # above them in the heap: glibc cannot give them back by shrinking it
    del freed
    release_free_heap()
    before = rss()
    bufs = [untouched_zeros((8 * MB // 4,), np.float32) for _ in range(32)]  # 256 MB
    assert rss() - before < 32 * MB
    bufs[0][:] = 1.0  # one buffer written: its pages, not the others'
    grown = rss() - before
    assert 6 * MB < grown < 48 * MB
    del pin
