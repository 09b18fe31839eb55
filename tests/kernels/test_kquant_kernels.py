"""The Q4_K / Q5_K / Q4_1 / Q5_0 / Q5_1 int8-activation kernels (kernels/linear/kquant.py: VNNI's and AVX2's,
each where the host runs it) against a float64 numpy reference over gguf's dequantization of the same raw
blocks and the same quantized activations; the two kernels' bits equal; batch invariance, the experts driver,
and the packing's exact round trip and size."""

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize

from kernels.formats import kquant_layout
from kernels.formats.ggml_blocks import CODE
from kernels.formats.int8_layout import padded_k, quantize_activations
from kernels.linear.chunking import linear_tiles
from kernels.linear.kquant import matmul_kquant, matmul_kquant_avx2, matmul_kquant_experts
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from kernels.simd.vnni import VNNI_FEATURES
from memory.block_matrices import KQuantMatrix
from memory.matrices import WeightMatrix
from tests.support.threads import EVERY_BATCH_SIZE, each_batch_size

CHUNK = linear_tiles().x_chunk_bytes

FORMATS = (QT.Q4_K, QT.Q5_K, QT.Q4_1, QT.Q5_0, QT.Q5_1)
requires_vnni = pytest.mark.skipif(bool(missing_features(VNNI_FEATURES)), reason="this CPU lacks AVX512-VNNI")
requires_avx2 = pytest.mark.skipif(bool(missing_features(AVX2_FEATURES)), reason="this CPU lacks AVX2, F16C")
KERNELS = [pytest.param(matmul_kquant, id="vnni", marks=requires_vnni),
           pytest.param(matmul_kquant_avx2, id="avx2", marks=requires_avx2)]


def fp16_fields(qtype: QT) -> int:
    # the raw block's leading fp16 fields: d, and dmin (K-quants) or m (Q4_1, Q5_1)
    return 1 if qtype == QT.Q5_0 else 2


def random_raw(qtype: QT, n: int, k: int, rng, scale: float = 0.01) -> np.ndarray:
    # random GGML blocks uint8 [N, K // values * bytes], their fp16 fields finite (~ scale, either sign)
    values, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    halves = (rng.standard_normal((n, k // values, fp16_fields(qtype))) * scale).astype(np.float16)
    raw[..., :2 * fp16_fields(qtype)] = halves.view(np.uint8)
    return raw.reshape(n, -1)


def activations(x: np.ndarray):
    t, k = x.shape
    kp = padded_k(k)
    xq, xd, xsum = np.empty((t, kp), np.int8), np.empty((t, kp // 32), np.float32), np.empty((t, kp // 32),
                                                                                             np.int32)
    quantize_activations(x, xq, xd, xsum)
    return xq, xd, xsum


def run(m: KQuantMatrix, x: np.ndarray, kernel=matmul_kquant) -> np.ndarray:
    out = np.empty((x.shape[0], m.shape[0]), np.float32)
    kernel(*activations(x), m.data, out, m.qtype, CHUNK)
    return out


def reference(raw: np.ndarray, qtype: QT, x: np.ndarray):
    # -> (x_q @ W.T in float64 over the same quantized activations, |x_q| @ |W|.T: the row's magnitude)
    xq, xd, _ = activations(x)
    t, kp = xq.shape
    k = x.shape[1]
    # quad order back to column order: [T, group, run j, block b, 4] -> [T, group, b, j, 4]
    cols = xq.reshape(t, kp // 256, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(t, kp)
    xv = (cols.astype(np.float64) * np.repeat(xd, 32, axis=1))[:, :k]
    w = dequantize(raw, qtype).astype(np.float64)
    return xv @ w.T, np.abs(xv) @ np.abs(w).T


def shapes(qtype: QT) -> list[int]:
    # K-quants: whole super-blocks; legacy: under a group, a partial last group, whole groups
    return [256, 512, 2048] if GGML_QUANT_SIZES[qtype][0] == 256 else [96, 800, 2048]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("case", range(3))
def test_matmul_equals_dequantized_reference(qtype, case, kernel):
    k = shapes(qtype)[case]
    n, t = [(5, 1), (9, 3), (37, 13)][case]  # N % 4 != 0: a last block's padding rows
    rng = np.random.default_rng(10 * case + int(qtype))
    raw = random_raw(qtype, n, k, rng)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero activation block: scale 0
    ref, magnitude = reference(raw, qtype, x)
    got = run(KQuantMatrix.pack(raw, qtype, k), x, kernel)
    assert np.all(np.abs(got - ref) <= 1e-5 * magnitude)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_every_batch_size_at_every_thread_count_equals_the_reference(qtype, kernel):
    rng = np.random.default_rng(23 + int(qtype))
    n, k = 30, shapes(qtype)[1]
    raw = random_raw(qtype, n, k, rng)
    m = KQuantMatrix.pack(raw, qtype, k)
    x = rng.standard_normal((max(EVERY_BATCH_SIZE), k)).astype(np.float32)
    for t, got in each_batch_size(lambda t: run(m, x[:t], kernel)):
        ref, magnitude = reference(raw, qtype, x[:t])
        assert np.all(np.abs(got - ref) <= 1e-5 * magnitude), f"T = {t}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", ["q4_k", "q5_k", "q4_1", "q5_0", "q5_1"])
def test_matmul_of_weights_quantized_by_from_float(dtype, kernel):
    # the blocks llama.cpp's quantizers write (positive d, dmin; signed m), not random bytes
    rng = np.random.default_rng(5)
    w = WeightMatrix.from_float(rng.standard_normal((13, 768)).astype(np.float32) * 0.02, dtype)
    assert w.dtype == dtype
    x = rng.standard_normal((6, 768)).astype(np.float32)
    ref, magnitude = reference(w.data, QT(CODE[dtype]), x)
    got = run(KQuantMatrix.pack(w.data, CODE[dtype], 768), x, kernel)
    assert np.all(np.abs(got - ref) <= 1e-5 * magnitude)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_edge_blocks_zero_and_largest_scales_and_several_token_chunks(qtype, kernel):
    # 150 tokens of K = 4096: x chunks of 128 tokens, two passes over the weights
    rng = np.random.default_rng(int(qtype))
    n, k = 11, 4096
    values, size = GGML_QUANT_SIZES[qtype]
    raw = random_raw(qtype, n, k, rng).reshape(n, -1, size)
    raw[0] = 0  # a zero row: every block's scales and quants 0
    raw[1, ::3] = 0  # zero blocks among others
    raw[2] = 255  # quants at their largest: 15 or 31; K-quants: every 6-bit scale and min 63
    largest = np.full(fp16_fields(qtype), 65504.0, np.float16)
    if qtype in (QT.Q4_1, QT.Q5_1):
        largest[1] = -65504.0  # m: the most negative offset
    raw[2, :, :2 * fp16_fields(qtype)] = largest.view(np.uint8)
    head = 2 * fp16_fields(qtype) + (12 if values == 256 else 0)  # the fp16 fields and K-quants' scales
    raw[3, :, head:] = 0  # quants 0: values -M_b (Q5_0: -16 d_b)
    raw = raw.reshape(n, -1)
    x = rng.standard_normal((150, k)).astype(np.float32)
    x[3, :] *= 1000.0
    ref, magnitude = reference(raw, qtype, x)
    got = run(KQuantMatrix.pack(raw, qtype, k), x, kernel)
    assert np.all(got[:, 0] == 0.0) and np.all(np.isfinite(got))
    assert np.all(np.abs(got - ref) <= 1e-5 * magnitude)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_integer_weights_and_activations_give_exact_sums(qtype, kernel):
    # d = dmin = 1 (and m = -1), small 6-bit scales, activations with block maximum 127 (scale 1): every float
    # operation is exact, so the kernel must return the exact integer dot products
    rng = np.random.default_rng(3)
    n, k, t = 6, 512, 5
    values, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // values, size), dtype=np.uint8)
    ones = np.array([1.0, 1.0 if values == 256 else -1.0], np.float16)[:fp16_fields(qtype)]
    raw[..., :2 * fp16_fields(qtype)] = ones.view(np.uint8)
    if values == 256:
        raw[..., 4:16] &= 0x03  # 6-bit scales and mins 0..3: the sums stay below 2 ** 24
    raw = raw.reshape(n, -1)
    x = rng.integers(-127, 128, (t, k)).astype(np.float32)
    x[:, ::32] = 127
    exact = x.astype(np.int64) @ dequantize(raw, qtype).astype(np.int64).T
    assert np.abs(exact).max() < 2 ** 24
    assert np.array_equal(run(KQuantMatrix.pack(raw, qtype, k), x, kernel), exact.astype(np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_a_tokens_outputs_are_the_same_bits_in_any_batch(qtype, kernel):
    rng = np.random.default_rng(7)
    n, k = 23, shapes(qtype)[1]
    m = KQuantMatrix.pack(random_raw(qtype, n, k, rng), qtype, k)
    x = rng.standard_normal((33, k)).astype(np.float32)
    alone = np.concatenate([run(m, x[i:i + 1], kernel) for i in range(33)])
    for t in (1, 2, 3, 5, 8, 33):
        np.testing.assert_array_equal(run(m, x[:t], kernel), alone[:t], err_msg=f"T = {t}")
        np.testing.assert_array_equal(run(m, x[33 - t:], kernel), alone[33 - t:], err_msg=f"the last {t}")


@requires_vnni
@requires_avx2
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_the_avx2_kernel_gives_the_vnni_kernels_bits(qtype):
    # its integer sums are vpdpbusd's (no pair saturates int16), the float steps the same
    rng = np.random.default_rng(13)
    n, k = 21, shapes(qtype)[2]
    m = KQuantMatrix.pack(random_raw(qtype, n, k, rng), qtype, k)
    for t in (1, 2, 3, 4, 6, 7, 13):  # the 512-bit block's 3, 2 and 1 pairs, an odd last row
        x = rng.standard_normal((t, k)).astype(np.float32)
        np.testing.assert_array_equal(run(m, x, matmul_kquant_avx2), run(m, x, matmul_kquant),
                                      err_msg=f"T = {t}")


@requires_vnni
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_experts_driver_equals_one_call_per_expert(qtype):
    rng = np.random.default_rng(11)
    num_experts, n, k = 5, 40, shapes(qtype)[1]  # 10 blocks of 4 rows: two tasks per expert, one partial
    raws = [random_raw(qtype, n, k, rng) for _ in range(num_experts)]
    data = np.concatenate([KQuantMatrix.pack(r, qtype, k).data for r in raws])
    experts, starts = np.array([3, 0, 4], np.int64), np.array([0, 2, 7, 8], np.int64)
    x = rng.standard_normal((8, k)).astype(np.float32)
    out = np.empty((8, n), np.float32)
    matmul_kquant_experts(*activations(x), data, out, int(qtype), experts, starts)
    for s, e in enumerate(experts):
        rows = slice(starts[s], starts[s + 1])
        np.testing.assert_array_equal(out[rows], run(KQuantMatrix.pack(raws[e], qtype, k), x[rows]))


@requires_vnni
def test_other_formats_are_refused():
    x = np.zeros((1, 256), np.float32)
    out = np.zeros((1, 4), np.float32)
    data = np.zeros((4, 148), np.uint8)
    with pytest.raises(ValueError, match="qtype"):
        matmul_kquant(*activations(x), data, out, int(QT.Q6_K), CHUNK)
    with pytest.raises(ValueError, match="qtype"):
        matmul_kquant_experts(*activations(x), data, out, int(QT.Q4_0), np.zeros(1, np.int64),
                              np.array([0, 1], np.int64))


@requires_avx2
@pytest.mark.parametrize("qtype", [QT.IQ4_NL, QT.IQ4_XS, QT.Q6_K], ids=lambda q: q.name)
def test_the_avx2_kernel_refuses_the_formats_it_cannot_sum_exactly(qtype):
    # IQ4's levels + 128 reach 255: a vpmaddubsw pair of them would saturate int16
    x = np.zeros((1, 256), np.float32)
    with pytest.raises(ValueError, match="AVX2"):
        matmul_kquant_avx2(*activations(x), np.zeros((4, 148), np.uint8), np.zeros((1, 4), np.float32),
                           int(qtype), CHUNK)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 6, 8])
def test_unpack_returns_the_raw_blocks_bit_for_bit(qtype, n):
    # every byte random, NaN and infinite fp16 fields included; N and K not whole blocks of the layout
    for k in shapes(qtype):
        values, size = GGML_QUANT_SIZES[qtype]
        raw = np.random.default_rng(n * k).integers(0, 256, (n, k // values * size), dtype=np.uint8)
        m = KQuantMatrix.pack(raw, qtype, k)
        assert m.shape == (n, k) and np.array_equal(m.unpack(), raw)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_packed_bytes_per_weight_are_within_3_percent_of_ggml(qtype):
    n, k = 64, 4096
    raw = random_raw(qtype, n, k, np.random.default_rng(0))
    assert raw.nbytes <= KQuantMatrix.pack(raw, qtype, k).nbytes <= 1.03 * raw.nbytes


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda q: q.name)
def test_packing_row_chunks_gives_the_whole_matrix_bytes(qtype, monkeypatch):
    # 21 rows, 8 at a time: whole chunks and a last one of 5 rows (padded to 8)
    k = shapes(qtype)[1]
    raw = random_raw(qtype, 21, k, np.random.default_rng(1))
    whole = KQuantMatrix.pack(raw, qtype, k)
    monkeypatch.setattr(kquant_layout, "PACK_ROWS", 8)
    chunked = KQuantMatrix.pack(raw, qtype, k)
    assert np.array_equal(chunked.data, whole.data) and np.array_equal(chunked.unpack(), raw)


def test_blocks_that_do_not_match_k_are_refused():
    with pytest.raises(ValueError, match="Q4_K rows of 300 values"):
        KQuantMatrix.pack(np.zeros((2, 144), np.uint8), QT.Q4_K, 300)
    with pytest.raises(ValueError, match="Q5_0 rows of 64 values"):
        KQuantMatrix.pack(np.zeros((2, 22), np.uint8), QT.Q5_0, 64)
