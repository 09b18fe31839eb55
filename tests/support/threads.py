"""A numba kernel's outputs at every thread count this process can run (1, 2, all), the count restored; and
the batch sizes a kernel's reference test sweeps."""

from collections.abc import Callable

import numba
import numpy as np

from kernels.formats.int8_layout import PARALLEL_MIN_TOKENS as QUANTIZE_PARALLEL
from kernels.formats.token_pairs import PARALLEL_MIN_TOKENS as PAIR_PARALLEL
from kernels.linear.bf16 import PARALLEL_MIN_TOKENS as ROUND_PARALLEL

# every token count of the kernels' blocks (4 tokens, 3 / 2 / 1 token pairs) and each remainder, then an odd
# count past the thresholds where the quantizers, the pairing and bf16's rounding go parallel
EVERY_BATCH_SIZE = (*range(1, 14), 1 + 2 * max(QUANTIZE_PARALLEL, PAIR_PARALLEL, ROUND_PARALLEL))


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
