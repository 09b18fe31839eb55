"""WeightMatrix.from_float to q4_k / q5_k / q6_k gives llama.cpp's bytes: its reference quantizers without an
importance matrix, and its fallback formats for rows that are not whole super-blocks.

The committed fixture (tests/fixtures/make_kquant_fixture.py) holds llama.cpp's output for a tiny model;
with llama-cpp-python installed the same comparison runs on freshly quantized files, and ggml's reference
row quantizers are called directly on a larger spread of rows."""

import ctypes
import importlib.util
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

from kernels.formats.ggml_blocks import row_bytes
from memory.matrices import WeightMatrix
from tests.fixtures.make_kquant_fixture import FIXTURE, TARGETS, make_fixture

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python (the bench extra) is not installed")


def assert_quantized_as_llama_cpp(arrays) -> None:
    names = [key for key in arrays if "/" not in key]
    for target in TARGETS:
        for name in names:
            w = WeightMatrix.from_float(arrays[name].view(np.float16).astype(np.float32), target)
            assert GT[w.dtype.upper()] == int(arrays[f"{target}/{name}/type"]), (target, name, w.dtype)
            ours, theirs = w.ggml_blocks(), arrays[f"{target}/{name}"]
            differing = np.flatnonzero((ours != theirs).any(axis=1))
            assert differing.size == 0, f"{target} {name}: rows {differing} differ from llama.cpp's"


def test_quantized_bytes_equal_llama_cpps_in_the_fixture():
    # 176 rows of 256 in the K-quants (zero rows and sub-blocks, outliers, one-signed, constant, subnormal)
    # and 512 rows of 32 in their fallbacks q5_0 / q5_1 / q8_0
    assert_quantized_as_llama_cpp(np.load(FIXTURE))


@needs_llama_cpp
def test_quantized_bytes_equal_llama_cpps_on_fresh_files(tmp_path):
    (tmp_path / "0").mkdir()
    (tmp_path / "1").mkdir()
    committed, again = np.load(FIXTURE), make_fixture(tmp_path / "0", seed=0)
    assert committed.files == list(again) and all(np.array_equal(committed[k], again[k]) for k in again)
    assert_quantized_as_llama_cpp(make_fixture(tmp_path / "1", seed=1))


def ggml_reference_rows(dtype: str, w: np.ndarray) -> np.ndarray:
    """w [N, K] through ggml's quantize_row_q{4,5,6}_K_ref, the functions llama-quantize runs without an
    importance matrix, from llama-cpp-python's libggml-base."""
    import llama_cpp

    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    quantize_row = getattr(lib, f"quantize_row_{dtype[:2]}_K_ref")
    out = np.empty((w.shape[0], row_bytes(dtype, w.shape[1])), np.uint8)
    quantize_row(w.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                 ctypes.c_int64(w.size))
    return out


@needs_llama_cpp
@pytest.mark.parametrize("dtype", TARGETS)
def test_quantized_bytes_equal_ggml_reference_rows(dtype):
    # 1536 rows of 512 values: Gaussian, uniform, heavy-tailed and f16-rounded rows over many scales
    rng = np.random.default_rng(2)
    scale = 10.0 ** rng.uniform(-6, 2, (512, 1))
    w = np.concatenate([rng.standard_normal((512, 512)) * scale, rng.uniform(-1, 1, (512, 512)) * scale,
                        (rng.standard_t(2, (512, 512)) * scale).astype(np.float16)]).astype(np.float32)
    w[rng.random(w.shape) < 0.002] = 0.0
    assert np.array_equal(WeightMatrix.from_float(w, dtype).data, ggml_reference_rows(dtype, w))


@pytest.mark.parametrize("dtype, k, served", [("q4_k", 96, "q5_0"), ("q5_k", 96, "q5_1"),
                                              ("q6_k", 96, "q8_0"), ("q4_k", 40, "bfloat16"),
                                              ("q4_k", 512, "q4_k")])
def test_rows_that_are_not_whole_super_blocks_take_llama_cpps_fallback(dtype, k, served):
    w = WeightMatrix.from_float(np.random.default_rng(0).standard_normal((3, k)).astype(np.float32), dtype)
    assert w.dtype == served and w.shape == (3, k)
