"""A 64-bit checksum of stored bytes, fast enough to verify a packed-weight cache entry at every start.

weighted_sum = sum of words[i] * (2 * (start + i) + 1), mod 2**64. The weights are odd, so invertible mod
2**64: a change confined to one 8-byte word always changes the sum; a random corruption (a torn write, a
zeroed page) goes unnoticed with a chance of about 2**-64. It guards storage, not against an adversary (the
cache's key holds the source's sha256). The loop vectorizes (AVX-512 vpmullq), so it runs several times faster
than zlib.crc32 or sha256 (benchmarks/results/HISTORY.md). Without vpmullq (AVX2) one thread sums under the
memory's rate: weighted_sum_parallel splits an array into pieces, one a task, whose sums add up (mod 2**64) to
the same value.
"""

import numpy as np
from numba import njit, prange

PIECE_WORDS = 1 << 19  # 4 MB a task


@njit(cache=True, nogil=True)
def weighted_sum(words: np.ndarray, start: int) -> np.uint64:
    """words: uint64 [n], word start + i of the stored bytes."""
    s = np.uint64(0)
    first = np.uint64(2 * start + 1)
    for i in range(words.shape[0]):
        s += words[i] * (first + np.uint64(2 * i))
    return s


@njit(cache=True, nogil=True, parallel=True)
def weighted_sum_parallel(words: np.ndarray, start: int) -> np.uint64:
    """weighted_sum(words, start), PIECE_WORDS words a task (one piece: on this thread)."""
    n = words.shape[0]
    if n <= PIECE_WORDS:
        return weighted_sum(words, start)
    pieces = (n + PIECE_WORDS - 1) // PIECE_WORDS
    sums = np.zeros(pieces, np.uint64)
    for p in prange(pieces):
        lo = p * PIECE_WORDS
        sums[p] = weighted_sum(words[lo:min(n, lo + PIECE_WORDS)], start + lo)
    s = np.uint64(0)
    for p in range(pieces):
        s += sums[p]
    return s
