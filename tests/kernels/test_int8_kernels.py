"""int8-activation kernels against a numpy reference that quantizes the same way and sums exactly.

The reference quantizes each 32-value block of x (d = max|x| / 127, q = rint(x * (1 / d)), or a static
scale with clipping), takes exact int64 block dot products with the weights' integer values, then
applies dw * dx per block in float64. The integer part must be bit-exact (checked with unit scales,
where every float operation is exact); the rest within float32 rounding.
"""

import numpy as np
import pytest

import numaserve as ns
from kernels.formats.fp16 import f32_to_f16
from kernels.formats.int8_layout import pack_q4_0, pack_q8_0, pad_scales, padded_k, quantize_activations
from kernels.linear.chunking import linear_tiles
from kernels.linear.int8 import matmul_int8
from kernels.simd.cpu import missing_features
from kernels.simd.vnni import VNNI_FEATURES
from memory.matrices import Int8Matrix, WeightMatrix
from models.linear import dequantize, linear
from tests.support.model_factory import build_model
from tests.support.threads import EVERY_BATCH_SIZE, each_batch_size

CHUNK = linear_tiles().x_chunk_bytes

FORMATS = ("q8_0", "q4_0")
HAS_VNNI = not missing_features(VNNI_FEATURES)
# every kernel the host can run: the AVX2 one, and the VNNI one where present
KERNELS = [False] + ([True] if HAS_VNNI else [])


def quantize_ref(x: np.ndarray, static_scale: float = 0.0):
    # x: [T, K] f32 (K % 32 == 0) -> q int64 [T, K // 32, 32], d f32 [T, K // 32]
    t, k = x.shape
    xb = x.reshape(t, k // 32, 32)
    if static_scale:
        d = np.full((t, k // 32), static_scale, np.float32)
        inv = np.float32(1.0) / np.float32(static_scale)
        q = np.clip(np.rint(xb * inv), -127, 127)
    else:
        d = (np.abs(xb).max(-1) / np.float32(127.0)).astype(np.float32)
        inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, 1), 0).astype(np.float32)
        q = np.rint(xb * inv[..., None])
    return q.astype(np.int64), d


def weight_values(w: WeightMatrix) -> np.ndarray:
    # integer values of a q8_0 / q4_0 matrix: int64 [N, K]
    n, k = w.shape
    if w.dtype == "q8_0":
        return w.data.astype(np.int64)
    blocks = w.data.reshape(n, k // 32, 16).astype(np.int64)
    return (np.concatenate([blocks & 15, blocks >> 4], -1) - 8).reshape(n, k)


def int8_matmul_ref(x: np.ndarray, w: WeightMatrix, static_scale: float = 0.0) -> np.ndarray:
    q, dx = quantize_ref(x, static_scale)
    n, k = w.shape
    isum = np.einsum("tbk,nbk->tnb", q, weight_values(w).reshape(n, k // 32, 32))  # exact int64
    dw = w.scales.view(np.float16).astype(np.float32)
    return (isum * (dx[:, None, :] * dw[None, :, :]).astype(np.float64)).sum(-1)


def run_kernel(x: np.ndarray, w: WeightMatrix, static_scale: float = 0.0, vnni: bool = False) -> np.ndarray:
    return linear(x, Int8Matrix.pack(w, static_scale, vnni=vnni))


@pytest.mark.parametrize("vnni", KERNELS)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("k", [32, 96, 256, 544])  # under a group, several groups, a partial last group
def test_packing_round_trips(dtype, k, vnni):
    w = WeightMatrix.from_float(np.random.default_rng(k).standard_normal((7, k)).astype(np.float32), dtype)
    back = Int8Matrix.pack(w, vnni=vnni).unpack()
    assert np.array_equal(back.data, w.data) and np.array_equal(back.scales, w.scales)


@pytest.mark.skipif(not HAS_VNNI, reason="this CPU lacks AVX512-VNNI")
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 70])  # 3, 2, 1 pairs, odd
def test_vnni_kernel_gives_the_avx2_kernels_bits(dtype, num_tokens):
    # the same integer sums and the same float operations in the same order: every output bit equal
    rng = np.random.default_rng(40 + num_tokens)
    w = WeightMatrix.from_float(rng.standard_normal((45, 800)).astype(np.float32) * 0.02, dtype)
    x = rng.standard_normal((num_tokens, 800)).astype(np.float32)
    x[0, 40:72] *= 300.0  # one block far larger than the rest
    if dtype == "q8_0":
        w.data[3, :32] = -128  # GGUF files may hold -128, below the quantizer's -127: 0 as an unsigned byte
    assert np.array_equal(run_kernel(x, w, vnni=True), run_kernel(x, w, vnni=False))


@pytest.mark.parametrize("vnni", KERNELS)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 8, 11])  # matvec, whole blocks, every remainder
def test_integer_part_is_bit_exact(dtype, num_tokens, vnni):
    # unit scales and integer activations: every float operation is exact, so the kernel's result must be
    # the exact integer sum
    rng = np.random.default_rng(num_tokens)
    n, k = 9, 544
    x = rng.integers(-127, 128, (num_tokens, k)).astype(np.float32)
    x[:, ::32] = 127  # every block's max is 127: d = 1, q = x
    if dtype == "q8_0":
        data = rng.integers(-127, 128, (n, k)).astype(np.int8)
    else:
        data = rng.integers(0, 256, (n, k // 2)).astype(np.uint8)
    w = WeightMatrix(dtype, data, np.full((n, k // 32), f32_to_f16(np.float32(1.0)), np.uint16))
    exact = (x.astype(np.int64) @ weight_values(w).T).astype(np.float64)
    assert np.abs(exact).max() < 2 ** 24  # representable in float32, so equality is the test
    assert np.array_equal(run_kernel(x, w, vnni=vnni), exact.astype(np.float32))


def _bound(x, w, k):
    # float32 rounding of the per-block scale products and of the float sums over blocks
    dq = np.abs(x).astype(np.float64) @ np.abs(dequantize(w)).T.astype(np.float64)
    return 4 * (k // 32 + 8) * np.finfo(np.float32).eps * (dq + 1e-30) + 1e-7


@pytest.mark.parametrize("vnni", KERNELS)
@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("k,num_tokens", [(256, 1), (96, 2), (544, 3), (256, 6), (2048, 13), (4096, 150)])
def test_matmul_equals_reference(dtype, k, num_tokens, vnni):
    # (4096, 150): x chunks of 64 tokens, so three passes over the weights
    rng = np.random.default_rng(k + num_tokens)
    w = WeightMatrix.from_float(rng.standard_normal((37, k)).astype(np.float32) * 0.02, dtype)
    x = rng.standard_normal((num_tokens, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0
    got = run_kernel(x, w, vnni=vnni)
    ref = int8_matmul_ref(x, w)
    assert np.all(np.abs(got - ref) <= _bound(x, w, k))


@pytest.mark.parametrize("vnni", KERNELS)
@pytest.mark.parametrize("dtype", FORMATS)
def test_every_batch_size_at_every_thread_count_equals_the_reference(dtype, vnni):
    rng = np.random.default_rng(29)
    k = 544
    w = WeightMatrix.from_float(rng.standard_normal((37, k)).astype(np.float32) * 0.02, dtype)
    packed = Int8Matrix.pack(w, vnni=vnni)
    x = rng.standard_normal((max(EVERY_BATCH_SIZE), k)).astype(np.float32)
    for t, got in each_batch_size(lambda t: linear(x[:t], packed)):
        assert np.all(np.abs(got - int8_matmul_ref(x[:t], w)) <= _bound(x[:t], w, k)), f"T = {t}"


@pytest.mark.parametrize("dtype", FORMATS)
def test_static_scale_clips_and_matches_reference(dtype):
    rng = np.random.default_rng(5)
    k = 512
    w = WeightMatrix.from_float(rng.standard_normal((21, k)).astype(np.float32) * 0.02, dtype)
    x = rng.standard_normal((9, k)).astype(np.float32)
    x[2, 7] = 40.0  # beyond 127 * scale: clipped to 127
    scale = 3.0 / 127
    got = run_kernel(x, w, scale)
    ref = int8_matmul_ref(x, w, scale)
    assert np.all(np.abs(got - ref) <= _bound(np.clip(x, -3, 3), w, k))


def test_quantizer_writes_the_layout_the_kernel_reads():
    # the quantizer alone against the reference: the packed activations hold exactly q, the scales d
    rng = np.random.default_rng(2)
    x = rng.standard_normal((3, 300)).astype(np.float32)
    kp = padded_k(300)
    xq, xd, xsum = (np.empty((3, kp), np.int16), np.empty((3, kp // 32), np.float32),
                    np.empty((3, kp // 32), np.int32))
    quantize_activations(x, xq, xd, xsum)
    q, d = quantize_ref(np.pad(x, ((0, 0), (0, kp - 300))))
    assert np.array_equal(xd, d) and np.array_equal(xsum, q.sum(-1))
    unit = WeightMatrix("q8_0", np.eye(kp, dtype=np.int8), np.full((kp, kp // 32), f32_to_f16(np.float32(1)),
                                                                    np.uint16))
    packed = np.zeros((kp, kp), np.int8)
    pack_q8_0(unit.data, packed)
    out = np.empty((3, kp), np.float32)
    unit_x = np.empty_like(xq)
    unit_x[:] = xq
    ones = np.ones_like(xd)
    matmul_int8(unit_x, ones, xsum, packed, pad_scales(unit.scales, kp), out, CHUNK)  # identity weights
    assert np.array_equal(out, q.reshape(3, kp).astype(np.float32))
    q4 = np.zeros((kp, kp // 2), np.uint8)
    # packs without error
    pack_q4_0(WeightMatrix.from_float(np.eye(kp, dtype=np.float32), "q4_0").data, q4, 1)


@pytest.mark.parametrize("dtype, width", [(np.int16, 2), (np.int8, 4)])
def test_quantizer_orders_each_group_in_runs_of_its_width(dtype, width):
    # pair order (int16, q8_0's kernel) and quad order (int8, q4_0's): value e of run j of block b of
    # group g sits at g * 256 + 8 * width * j + width * b + e
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 600)).astype(np.float32)
    kp = padded_k(600)
    xq = np.empty((2, kp), dtype)
    quantize_activations(x, xq, np.empty((2, kp // 32), np.float32), np.empty((2, kp // 32), np.int32))
    q = quantize_ref(np.pad(x, ((0, 0), (0, kp - 600))))[0].reshape(2, kp // 256, 8, 32 // width, width)
    assert np.array_equal(xq.reshape(2, kp // 256, 32 // width, 8, width), q.transpose(0, 1, 3, 2, 4))


@pytest.fixture(scope="module")
def q_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("int8-model")
    build_model(path, "llama", seed=3, initializer_range=0.02, hidden_size=128, intermediate_size=352,
                head_dim=32)
    return path


@pytest.mark.parametrize("dtype", FORMATS)
def test_engine_runs_every_quantized_matrix_with_int8_activations(q_model, dtype):
    llm = ns.LLM(q_model, weight_dtype=dtype, activation_dtype="int8")
    chosen = {d["subject"]: d["choice"] for d in llm.diagnostics() if d["topic"] == "activation_dtype"}
    assert set(chosen.values()) == {"int8"} and "lm_head" in chosen and "layers.1.down" in chosen
    ref = ns.LLM(q_model, weight_dtype=dtype, activation_dtype="float32")
    tokens = list(range(3, 40))
    assert np.abs(llm.score(tokens) - ref.score(tokens)).max() < 0.05 * np.abs(ref.score(tokens)).max()


def test_missing_instructions_fall_back_to_float32_with_a_reason(q_model, monkeypatch):
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx2")
    llm = ns.LLM(q_model, weight_dtype="q8_0", activation_dtype="int8")
    [decision] = [d for d in llm.diagnostics() if d["topic"] == "activation_dtype"]
    assert decision["choice"] == "float32" and "lacks avx2" in decision["reason"]
    monkeypatch.delenv("NUMASERVE_DISABLE_CPU_FEATURES")
    exact = ns.LLM(q_model, weight_dtype="q8_0", activation_dtype="float32")
    tokens = list(range(3, 30))
    assert np.array_equal(llm.score(tokens), exact.score(tokens))


def test_bfloat16_activations_without_avx512_bf16_fall_back_with_a_reason(q_model, monkeypatch):
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx512bf16")
    llm = ns.LLM(q_model, weight_dtype="bfloat16", activation_dtype="bfloat16")
    [decision] = [d for d in llm.diagnostics() if d["topic"] == "activation_dtype"]
    assert decision["choice"] == "float32" and "lacks avx512bf16" in decision["reason"]
