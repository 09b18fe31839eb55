"""float32 activations on the GGML block formats: linear gives the float32 kernel's bits on the dequantized
matrix at every batch size, so a token's outputs do not depend on its batch."""

import numpy as np
import pytest

from memory.matrices import WeightMatrix, row_block
from models.linear import dequantize, linear

FORMATS = [("q4_k", 512), ("q5_k", 512), ("q6_k", 512), ("q4_1", 96), ("q5_0", 96), ("q5_1", 96)]


def matrix(dtype: str, n: int, k: int) -> WeightMatrix:
    rng = np.random.default_rng(n)
    w = rng.standard_normal((n, k)) * rng.uniform(1e-3, 2, (n, 1))
    w[0] = 0.0
    w[1, 7] = 40.0
    return WeightMatrix.from_float(w.astype(np.float32), dtype)


# 1-4 tokens: one partial register block; 1500: several chunks of x (256 tokens at K = 512, 1364 at 96)
@pytest.mark.parametrize("dtype, k", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 7, 33, 1500])
def test_linear_equals_the_float32_kernel_on_the_dequantized_matrix(dtype, k, num_tokens):
    w = matrix(dtype, 70, k)  # 70 rows: a last group of 2
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, k)).astype(np.float32)
    assert np.array_equal(linear(x, w), linear(x, WeightMatrix("float32", dequantize(w))))


@pytest.mark.parametrize("dtype, k", FORMATS)
def test_a_tokens_outputs_do_not_depend_on_its_batch(dtype, k):
    w = matrix(dtype, 3, k)  # fewer rows than one group
    x = np.random.default_rng(0).standard_normal((9, k)).astype(np.float32)
    batch = linear(x, w)
    for t in (0, 4, 8):
        assert np.array_equal(linear(x[t:t + 1], w)[0], batch[t])
        assert np.array_equal(linear(x[t:t + 5], w)[0], batch[t])


def test_a_row_block_view_runs_over_its_rows_only():
    # a MoE expert's rows of a stacked matrix (memory/weights.row_block) go through the same kernel
    w = matrix("q4_k", 24, 256)
    x = np.random.default_rng(1).standard_normal((5, 256)).astype(np.float32)
    assert np.array_equal(linear(x, row_block(w, 8, 19)), linear(x, w)[:, 8:19])
