"""A numba kernel's outputs at every thread count this process can run (1, 2, all), the count restored; and
the batch sizes a kernel's reference test sweeps, each at every thread count."""

from collections.abc import Callable, Iterator

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


def each_batch_size(run: Callable[[int], np.ndarray]) -> Iterator[tuple[int, np.ndarray]]:
    """(T, run(T)) for every T of EVERY_BATCH_SIZE, once run(T) has given the same bits at every thread count
    (a kernel's reference test checks each output against its reference)."""
    for t in EVERY_BATCH_SIZE:
        first, *others = at_each_thread_count(lambda t=t: run(t))
        for other in others:
            np.testing.assert_array_equal(other, first, err_msg=f"T = {t}")
        yield t, first
