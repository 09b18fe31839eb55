"""Sums across the ranks of a tensor-parallel group: each rank's partial result sits in its slot of a shared
segment, and every rank adds the slots in rank order, so each gets the same bits whatever the timing."""

import numpy as np
from numba import njit, prange

PARALLEL_ELEMS = 1 << 16  # below this a sum is a few microseconds: threads would cost more than they save


@njit(cache=True, nogil=True)
def _sum_range(slots: np.ndarray, n: int, out: np.ndarray, lo: int, hi: int) -> None:
    # the first two ranks in one pass (out written once, not copied then added to), then rank by rank: each
    # element still adds in rank order, and the loops vectorize (1-D views: no aliasing check per row)
    first, second = slots[0], slots[1 % n]
    if n == 1:
        for i in range(lo, hi):
            out[i] = first[i]
        return
    for i in range(lo, hi):
        out[i] = first[i] + second[i]
    for r in range(2, n):
        row = slots[r]
        for i in range(lo, hi):
            out[i] += row[i]


@njit(cache=True, nogil=True, parallel=True)
def _sum_parallel(slots: np.ndarray, n: int, out: np.ndarray, num_elems: int, num_tasks: int) -> None:
    step = (num_elems + num_tasks - 1) // num_tasks
    for t in prange(num_tasks):
        _sum_range(slots, n, out, t * step, min(num_elems, (t + 1) * step))


@njit(cache=True, nogil=True)
def sum_slots(slots: np.ndarray, num_elems: int, out: np.ndarray, num_tasks: int) -> None:
    """out[:num_elems] = ((slots[0] + slots[1]) + slots[2]) + ...: the same order on every rank.

    slots: float32 [num_ranks, capacity]; out: float32 [>= num_elems]; num_tasks > 1 splits the elements
    between threads (each element's order of additions is unchanged, so the bits are too)."""
    n = slots.shape[0]
    if num_tasks > 1 and num_elems >= PARALLEL_ELEMS:
        _sum_parallel(slots, n, out, num_elems, num_tasks)
    else:
        _sum_range(slots, n, out, 0, num_elems)
