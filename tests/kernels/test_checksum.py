"""kernels/checksum.py: the weighted sum of a run of 8-byte words against its definition (numpy's uint64
arithmetic wraps mod 2**64), one thread or in pieces over any number of threads."""

import numba
import numpy as np
import pytest

from kernels.checksum import PIECE_WORDS, weighted_sum, weighted_sum_parallel


def reference(words: np.ndarray, start: int) -> int:
    weights = np.arange(start, start + len(words), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    return int((words * weights).sum(dtype=np.uint64))


@pytest.mark.parametrize("n", [0, 1, 1000, PIECE_WORDS, PIECE_WORDS + 1, 2 * PIECE_WORDS + 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_sum_in_pieces_is_the_sum_of_its_definition(n, threads):
    rng = np.random.default_rng(n)
    words = rng.integers(0, np.iinfo(np.uint64).max, n, dtype=np.uint64, endpoint=True)
    start = 12345
    before = numba.get_num_threads()
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    try:
        assert int(weighted_sum_parallel(words, start)) == reference(words, start)
    finally:
        numba.set_num_threads(before)
    assert int(weighted_sum(words, start)) == reference(words, start)


def test_a_change_to_one_word_changes_the_sum():
    words = np.zeros(PIECE_WORDS + 5, np.uint64)
    clean = int(weighted_sum_parallel(words, 0))
    words[PIECE_WORDS + 2] = 1 << 63  # the top bit: times an odd weight, still 2**63 mod 2**64
    assert int(weighted_sum_parallel(words, 0)) != clean
