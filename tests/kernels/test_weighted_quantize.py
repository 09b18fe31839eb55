"""WeightMatrix.from_float with an importance matrix gives llama.cpp's bytes: ggml's importance-weighted
quantizers (quantize_row_*_impl, what llama-quantize runs with --imatrix) for q4_0, q4_1, q5_0, q5_1, q4_k,
q5_k, q6_k, iq4_nl and iq4_xs, each group of rows (an expert's) with its own importance.

The committed fixture (tests/fixtures/make_weighted_fixture.py) holds ggml's output; with llama-cpp-python
installed the fixture is regenerated and another seed's rows compared as well."""

import importlib.util

import numpy as np
import pytest

from memory.matrices import WeightMatrix
from models.linear import dequantize
from tests.fixtures.make_weighted_fixture import DTYPES, FIXTURE, make_fixture

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python (the bench extra) is not installed")


def assert_weighted_as_ggml(arrays) -> None:
    rows, importance = arrays["rows"], arrays["importance"]
    for dtype in DTYPES:
        ours = WeightMatrix.from_float(rows, dtype, importance)
        assert ours.dtype == dtype
        differing = np.flatnonzero((ours.ggml_blocks() != arrays[dtype]).any(axis=1))
        assert differing.size == 0, f"{dtype}: rows {differing} differ from ggml's"


def test_weighted_bytes_equal_ggmls_in_the_fixture():
    assert_weighted_as_ggml(np.load(FIXTURE))


@needs_llama_cpp
def test_weighted_bytes_equal_ggmls_on_fresh_rows():
    committed, again = np.load(FIXTURE), make_fixture(seed=0)
    assert all(np.array_equal(committed[k], again[k]) for k in again)
    assert_weighted_as_ggml(make_fixture(seed=1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_importance_changes_the_quantization_and_lowers_its_weighted_error(dtype):
    # the same rows without and with an importance that favours a quarter of the columns: the bytes differ,
    # and the favoured columns' squared error (what the importance weighs) is lower with it
    rng = np.random.default_rng(3)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    importance = np.ones((1, 512), np.float32)
    importance[0, ::4] = 100.0
    plain, weighted = WeightMatrix.from_float(w, dtype), WeightMatrix.from_float(w, dtype, importance)
    assert not np.array_equal(plain.ggml_blocks(), weighted.ggml_blocks())

    def favoured_error(m: WeightMatrix) -> float:
        return float(((dequantize(m) - w)[:, ::4] ** 2).sum())

    assert favoured_error(weighted) < favoured_error(plain)


def test_importance_groups_must_divide_the_rows():
    with pytest.raises(ValueError, match="importance groups"):
        WeightMatrix.from_float(np.zeros((6, 256), np.float32), "q4_k", np.ones((4, 256), np.float32))
