"""The paired activation layout (kernels/formats/token_pairs.py) against a numpy statement of it."""

from itertools import pairwise

import numpy as np
import pytest

from kernels.formats.token_pairs import BLOCKS, VALUES, pair_tokens, whole_batch


def paired_ref(a: np.ndarray, starts: list[int], width: int) -> np.ndarray:
    # each segment's rows 2i, 2i + 1 (from its start) interleaved every `width` values; an odd last row as is
    out = a.copy()
    for r0, r1 in pairwise(starts):
        for t in range(r0, r1 - 1, 2):
            c = a.shape[1]
            pair = a[t:t + 2].reshape(2, c // width, width).transpose(1, 0, 2)  # [vectors, row, width]
            out[t:t + 2] = pair.reshape(2, c)
    return out


def _activations(rng, num_tokens, kp):
    return (rng.integers(-127, 128, (num_tokens, kp)).astype(np.int8),
            rng.standard_normal((num_tokens, kp // 32)).astype(np.float32),
            rng.integers(-4064, 4065, (num_tokens, kp // 32)).astype(np.int32))


@pytest.mark.parametrize("starts", [[0, 1], [0, 2], [0, 7], [0, 12], [0, 3, 3, 4, 9, 10], [0, 5, 11]])
def test_pairs_are_each_segments_rows_interleaved(starts):
    rng = np.random.default_rng(len(starts) + starts[-1])
    xq, xd, xsum = _activations(rng, starts[-1], 512)
    pq, pd, psum = pair_tokens(xq, xd, xsum, np.array(starts, np.int64))
    assert np.array_equal(pq, paired_ref(xq, starts, VALUES))
    assert np.array_equal(pd, paired_ref(xd, starts, BLOCKS))
    assert np.array_equal(psum, paired_ref(xsum, starts, BLOCKS))


def test_a_pairs_vector_is_its_first_rows_then_its_second():
    xq, xd, xsum = _activations(np.random.default_rng(1), 3, 256)
    pq, _, _ = pair_tokens(xq, xd, xsum, whole_batch(3))
    vectors = pq[:2].reshape(-1, 2, VALUES)  # [vector, row of the pair, value]
    for v in range(256 // VALUES):
        for h in range(2):
            assert np.array_equal(vectors[v, h], xq[h, v * VALUES:(v + 1) * VALUES])
    assert np.array_equal(pq[2], xq[2])  # the odd last row stays where it was
