"""bf16-activation kernel (kernels/simd/bf16.py, kernels/linear/bf16.py) against a float64 reference of the
same bf16-rounded operands, its batch invariance, its packing, and the engine running it."""

import numpy as np
import pytest

import numaserve as ns
from kernels.formats.bf16 import from_bf16, to_bf16
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import missing_features
from memory.matrices import Bf16Matrix, WeightMatrix
from models.linear import linear
from tests.support.model_factory import build_model
from tests.support.threads import EVERY_BATCH_SIZE, each_batch_size

pytestmark = pytest.mark.skipif(bool(missing_features(BF16_FEATURES)), reason="this CPU lacks AVX512-BF16")


def bf16_matrix(n: int, k: int, seed: int) -> WeightMatrix:
    return WeightMatrix.from_float(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32),
                                   "bfloat16")


# whole blocks and groups, and partial ones
@pytest.mark.parametrize("n, k", [(4, 128), (7, 300), (37, 1000)])
def test_packing_round_trips(n, k):
    w = bf16_matrix(n, k, n)
    assert np.array_equal(Bf16Matrix.pack(w).unpack().data, w.data)


def reference(x: np.ndarray, w: WeightMatrix) -> tuple[np.ndarray, np.ndarray]:
    # (the float64 product of the bf16-rounded operands, the float32 sums' rounding bound)
    xb, wb = from_bf16(to_bf16(x)).astype(np.float64), from_bf16(w.data).astype(np.float64)
    k = x.shape[1]
    return xb @ wb.T, 4 * (k // 16 + 8) * np.finfo(np.float32).eps * (np.abs(xb) @ np.abs(wb).T) + 1e-7


# (4096, 150): x chunks of 64 tokens, so three passes over the weights
@pytest.mark.parametrize("n, k, num_tokens", [(4, 128, 1), (37, 300, 5), (64, 1024, 9), (13, 256, 70),
                                              (9, 4096, 150)])
def test_matmul_equals_the_float64_product_of_the_bf16_operands(n, k, num_tokens):
    rng = np.random.default_rng(n + k)
    w = bf16_matrix(n, k, k)
    x = rng.standard_normal((num_tokens, k)).astype(np.float32)
    ref, bound = reference(x, w)
    assert np.all(np.abs(linear(x, Bf16Matrix.pack(w)) - ref) <= bound)


def test_every_batch_size_at_every_thread_count_equals_the_reference():
    rng = np.random.default_rng(31)
    w = bf16_matrix(37, 300, 4)
    packed = Bf16Matrix.pack(w)
    x = rng.standard_normal((max(EVERY_BATCH_SIZE), 300)).astype(np.float32)
    for t, got in each_batch_size(lambda t: linear(x[:t], packed)):
        ref, bound = reference(x[:t], w)
        assert np.all(np.abs(got - ref) <= bound), f"T = {t}"


def test_a_tokens_outputs_do_not_depend_on_its_batch():
    w = Bf16Matrix.pack(bf16_matrix(45, 640, 1))
    x = np.random.default_rng(2).standard_normal((23, 640)).astype(np.float32)
    together = linear(x, w)
    for rows in (slice(0, 1), slice(3, 5), slice(5, 12), slice(12, 23)):
        assert np.array_equal(linear(x[rows], w), together[rows])


def test_the_engine_runs_bf16_weights_with_bf16_activations_and_says_so(tmp_path):
    build_model(tmp_path, "llama", seed=3, initializer_range=0.02, hidden_size=128, intermediate_size=352,
                head_dim=32)
    llm = ns.LLM(tmp_path, weight_dtype="bfloat16", activation_dtype="bfloat16")
    chosen = {d["subject"]: d["choice"] for d in llm.diagnostics() if d["topic"] == "activation_dtype"}
    assert set(chosen.values()) == {"bfloat16"} and "lm_head" in chosen
    kernels = {d["choice"] for d in llm.diagnostics() if d["topic"] == "kernel"}
    assert kernels == {"matmul_bf16: bfloat16 weights x bfloat16 activations"}
    exact = ns.LLM(tmp_path, weight_dtype="bfloat16", activation_dtype="float32")
    tokens = list(range(3, 40))
    got, ref = llm.score(tokens), exact.score(tokens)
    assert not np.array_equal(got, ref) and np.abs(got - ref).max() < 0.05 * np.abs(ref).max()
