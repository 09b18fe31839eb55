"""The Q6_K x int8-activation kernels (kernels/linear/q6k.py: VNNI's and AVX2's, each where the host runs it)
against a float64 numpy product of the gguf package's dequantization of the same raw blocks with the same
quantized activations; the two kernels' bits equal; batch and thread-count invariance, the packing's round
trip and the experts driver."""

import gguf
import numpy as np
import pytest

from kernels.formats.int8_layout import quantize_activations
from kernels.formats.q6k_layout import RAW_BYTES, subblock_offsets
from kernels.linear.chunking import linear_tiles
from kernels.linear.q6k import matmul_q6k, matmul_q6k_avx2, matmul_q6k_experts
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from kernels.simd.q6k import Q6K_FEATURES
from memory.block_matrices import Q6KMatrix
from tests.support.threads import EVERY_BATCH_SIZE, each_batch_size

CHUNK = linear_tiles().x_chunk_bytes

requires_vnni = pytest.mark.skipif(bool(missing_features(Q6K_FEATURES)), reason="this CPU lacks AVX512-VNNI")
requires_avx2 = pytest.mark.skipif(bool(missing_features(AVX2_FEATURES)), reason="this CPU lacks AVX2")
KERNELS = [pytest.param(matmul_q6k, id="vnni", marks=requires_vnni),
           pytest.param(matmul_q6k_avx2, id="avx2", marks=requires_avx2)]


def random_raw(rng, n: int, k: int, d_scale: float = 1e-3) -> np.ndarray:
    """Random Q6_K blocks: uint8 [n, k // 256 * 210], every byte random but d a finite fp16."""
    raw = rng.integers(0, 256, (n, k // 256 * RAW_BYTES), dtype=np.uint8)
    d = (rng.standard_normal((n, k // 256)) * d_scale).astype(np.float16)
    raw.reshape(n, k // 256, RAW_BYTES)[:, :, 208:] = d.view(np.uint8).reshape(n, k // 256, 2)
    return raw


def quantized(x: np.ndarray):
    t, k = x.shape
    xq = np.empty((t, k), np.int8)
    xd, xsum = np.empty((t, k // 32), np.float32), np.empty((t, k // 32), np.int32)
    quantize_activations(x, xq, xd, xsum)
    return xq, xd, xsum


def natural_order(xq: np.ndarray) -> np.ndarray:
    # the quad order (kernels/formats/int8_layout.py: value e of run j of block b at 32 j + 4 b + e) back to
    # columns
    t, k = xq.shape
    return xq.reshape(t, k // 256, 8, 8, 4).transpose(0, 1, 3, 2, 4).reshape(t, k)


def reference(raw: np.ndarray, xq: np.ndarray, xd: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x @ W.T, |x| @ |W|.T) in float64, W = gguf's dequantization of raw, x = the quantized activations."""
    n, k = raw.shape[0], xq.shape[1]
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k).astype(np.float64)
    x = natural_order(xq).astype(np.float64) * np.repeat(xd.astype(np.float64), 32, axis=1)
    return x @ w.T, np.abs(x) @ np.abs(w).T


def run(raw: np.ndarray, x: np.ndarray, kernel=matmul_q6k) -> np.ndarray:
    packed = Q6KMatrix.pack(raw, (raw.shape[0], x.shape[1]))
    out = np.empty((x.shape[0], raw.shape[0]), np.float32)
    kernel(*quantized(x), packed.data, packed.d, out, CHUNK)
    return out


def assert_matches_reference(raw, x, kernel):
    got = run(raw, x, kernel)
    ref, magnitude = reference(raw, *quantized(x)[:2])
    assert np.all(np.abs(got - ref) <= 1e-5 * magnitude + 1e-30)


@pytest.mark.parametrize("n,k,num_tokens", [(7, 256, 1), (4, 2048, 2), (13, 512, 5), (9, 2048, 33),
                                            (5, 2048, 300)])  # 300 tokens: two passes over the weights
@pytest.mark.parametrize("kernel", KERNELS)
def test_matmul_equals_reference(n, k, num_tokens, kernel):
    rng = np.random.default_rng(n * k + num_tokens)
    x = rng.standard_normal((num_tokens, k)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero block of x: scale 0
    assert_matches_reference(random_raw(rng, n, k), x, kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_batch_size_at_every_thread_count_equals_the_reference(kernel):
    rng = np.random.default_rng(19)
    raw = random_raw(rng, 30, 512)
    x = rng.standard_normal((max(EVERY_BATCH_SIZE), 512)).astype(np.float32)
    for t, got in each_batch_size(lambda t: run(raw, x[:t], kernel)):
        ref, magnitude = reference(raw, *quantized(x[:t])[:2])
        assert np.all(np.abs(got - ref) <= 1e-5 * magnitude + 1e-30), f"T = {t}"


@pytest.mark.parametrize("k", [256, 2048])
@pytest.mark.parametrize("kernel", KERNELS)
def test_extreme_blocks_match_reference(k, kernel):
    # zero blocks, scales -128 and 127 with q at 0 and 63 (values -32 and 31), x at full scale: the int32 sums
    # at their largest (2 x 16 x 32 x 127 x 128 per block) stay exact
    rng = np.random.default_rng(k)
    raw = random_raw(rng, 6, k).reshape(6, k // 256, RAW_BYTES)
    raw[0] = 0  # all-zero blocks: d = 0
    raw[1, :, :192] = 0  # q = 0 everywhere
    raw[1, :, 192:208] = np.uint8(128)  # scale -128
    raw[2, :, :192] = 255  # q = 63 everywhere
    raw[2, :, 192:208] = 127
    raw[3, :, 192:208] = np.array([128, 127] * 8, np.uint8)  # alternating -128 and 127
    raw[4, :, :192] = 255 * rng.integers(0, 2, (k // 256, 192))  # each byte's bits all 0 or all 1
    x = np.ones((3, k), np.float32)
    x[1] = -1.0
    x[2] = rng.standard_normal(k).astype(np.float32)
    raw = raw.reshape(6, -1)
    assert_matches_reference(raw, x, kernel)
    assert np.all(run(raw, x, kernel)[:, 0] == 0)


@pytest.mark.parametrize("kernel", KERNELS)
def test_integer_sums_are_exact(kernel):
    # d = 1 and integer activations with a 127 in every block (scale 1): every float operation is exact, so
    # the outputs are the exact integer sums
    rng = np.random.default_rng(7)
    n, k = 6, 2048
    raw = random_raw(rng, n, k).reshape(n, k // 256, RAW_BYTES)
    raw[:, :, 192:208] = rng.integers(-4, 5, (n, k // 256, 16)).astype(np.int8).view(np.uint8)
    raw[:, :, 208:] = np.array([1.0], np.float16).view(np.uint8)
    raw = raw.reshape(n, -1)
    x = rng.integers(-127, 128, (5, k)).astype(np.float32)
    x[:, ::32] = 127
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q6_K).reshape(n, k).astype(np.int64)
    exact = x.astype(np.int64) @ w.T
    assert np.abs(exact).max() < 2 ** 24
    assert np.array_equal(run(raw, x, kernel), exact.astype(np.float32))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_tokens_outputs_do_not_depend_on_its_batch(kernel):
    rng = np.random.default_rng(11)
    n, k = 10, 1024
    packed = Q6KMatrix.pack(random_raw(rng, n, k), (n, k))
    x = rng.standard_normal((33, k)).astype(np.float32)

    def outputs(rows):
        out = np.empty((len(rows), n), np.float32)
        kernel(*quantized(x[rows]), packed.data, packed.d, out, CHUNK)
        return out

    alone = np.concatenate([outputs([i]) for i in range(33)])
    for num_tokens in (2, 3, 5, 8, 33):
        rows = rng.permutation(33)[:num_tokens]  # each token at some position of a block of 4, 2 or 1
        assert np.array_equal(outputs(rows), alone[rows])


@pytest.mark.parametrize("n,k", [(1, 256), (6, 2048), (12, 768)])
def test_packing_round_trips_any_bytes(n, k):
    raw = np.random.default_rng(n).integers(0, 256, (n, k // 256 * RAW_BYTES), dtype=np.uint8)  # any d bits
    packed = Q6KMatrix.pack(raw, (n, k))
    assert np.array_equal(packed.unpack(), raw)
    assert packed.nbytes * 8 == -(-n // 4) * 4 * k * 6.5625  # as the file, padded to whole blocks of 4 rows


def test_packing_rejects_a_shape_that_is_not_q6k():
    with pytest.raises(ValueError, match="Q6_K"):
        Q6KMatrix.pack(np.zeros((4, 210), np.uint8), (4, 512))


def test_subblock_offsets_are_minus_32_times_the_half_block_sums():
    x = np.random.default_rng(4).standard_normal((3, 512)).astype(np.float32)
    xq, _, xsum = quantized(x)
    offsets = np.empty((3, 32), np.int32)
    subblock_offsets(xq, xsum, offsets)
    halves = natural_order(xq).astype(np.int64).reshape(3, 2, 8, 2, 16).sum(-1)  # [t, group, block, half]
    assert np.array_equal(offsets.reshape(3, 2, 2, 8), -32 * halves.transpose(0, 1, 3, 2))


@requires_vnni
def test_experts_driver_equals_one_call_per_expert():
    rng = np.random.default_rng(9)
    num_experts, n, k = 4, 40, 512  # 40 rows: 10 blocks of 4, two tasks per expert
    raws = [random_raw(rng, n, k) for _ in range(num_experts)]
    packs = [Q6KMatrix.pack(r, (n, k)) for r in raws]
    data = np.concatenate([p.data for p in packs])
    d = np.concatenate([p.d for p in packs])
    experts = np.array([2, 0, 3], np.int64)
    starts = np.array([0, 3, 4, 9], np.int64)
    x = rng.standard_normal((9, k)).astype(np.float32)
    xq, xd, xsum = quantized(x)
    out = np.empty((9, n), np.float32)
    matmul_q6k_experts(xq, xd, xsum, data, d, out, experts, starts)
    for s, e in enumerate(experts):
        r0, r1 = starts[s], starts[s + 1]
        alone = np.empty((r1 - r0, n), np.float32)
        matmul_q6k(xq[r0:r1], xd[r0:r1], xsum[r0:r1], packs[e].data, packs[e].d, alone, CHUNK)
        assert np.array_equal(out[r0:r1], alone)


@requires_vnni
@requires_avx2
def test_the_avx2_kernel_gives_the_vnni_kernels_bits():
    rng = np.random.default_rng(21)
    raw = random_raw(rng, 11, 2048)
    for num_tokens in (1, 2, 3, 4, 7):
        x = rng.standard_normal((num_tokens, 2048)).astype(np.float32)
        assert np.array_equal(run(raw, x, matmul_q6k_avx2), run(raw, x, matmul_q6k)), num_tokens
