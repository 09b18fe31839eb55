"""A numba kernel's outputs at every thread count this process can run (1, 2, all), the count restored; and
the batch sizes a kernel's reference test sweeps."""

from collections.abc import Callable

import numba
import numpy as np

# every token count of the kernels' blocks (4 tokens, 3 / 2 / 1 token pairs) and each remainder, then an odd
# count past the thresholds where the quantizers and the pairing go parallel (16 rows)
EVERY_BATCH_SIZE = (*range(1, 14), 41)


def at_each_thread_count(run: Callable[[], np.ndarray]) -> list[np.ndarray]:
    before = numba.get_num_threads()
    counts = sorted({1, min(2, numba.config.NUMBA_NUM_THREADS), numba.config.NUMBA_NUM_THREADS})
    try:
        outputs = []
        for threads in counts:
            numba.set_num_threads(threads)
            outputs.append(run())
        return outputs
    finally:
        numba.set_num_threads(before)
