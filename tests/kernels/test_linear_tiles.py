"""The linear kernels' x chunk is this CPU's (half of a core's L2, from /sys): every kernel gives the same
bits whatever the chunk, and the L2's size is read as the kernel reports it."""

import os

import numpy as np
import pytest

import models.linear
from kernels.linear.chunking import DEFAULT_L2_BYTES, LinearTiles, linear_tiles
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import l2_cache, missing_features
from kernels.simd.int8 import AVX2_FEATURES
from kernels.simd.q6k import Q6K_FEATURES
from kernels.simd.vnni import VNNI_FEATURES
from memory.matrices import Bf16Matrix, BlockInt8Matrix, Int8Matrix, WeightMatrix
from models.linear import linear

K = 512


def weights(dtype: str) -> WeightMatrix:
    rng = np.random.default_rng(len(dtype))
    return WeightMatrix.from_float((rng.standard_normal((36, K)) * 0.1).astype(np.float32), dtype)


MATRICES = {  # one per kernel of kernels/linear (AVX2's K-quant and Q6_K kernels too)
    "float32": lambda: weights("float32"),
    "q4_1 blocks": lambda: weights("q4_1"),
    "bf16": lambda: Bf16Matrix.pack(weights("bfloat16")),
    "q8_0 int8": lambda: Int8Matrix.pack(weights("q8_0"), vnni=False),
    "q8_0 vnni": lambda: Int8Matrix.pack(weights("q8_0"), vnni=True),
    "q4_0 vnni": lambda: Int8Matrix.pack(weights("q4_0"), vnni=True),
    "q4_k": lambda: BlockInt8Matrix.pack(weights("q4_k")),
    "q4_k avx2": lambda: BlockInt8Matrix.pack(weights("q4_k"), vnni=False),
    "q6_k": lambda: BlockInt8Matrix.pack(weights("q6_k")),
    "q6_k avx2": lambda: BlockInt8Matrix.pack(weights("q6_k"), vnni=False),
}
NEEDS = {"q8_0 vnni": VNNI_FEATURES, "q4_0 vnni": VNNI_FEATURES, "q4_k": VNNI_FEATURES, "q6_k": Q6K_FEATURES,
         "bf16": BF16_FEATURES, "q8_0 int8": AVX2_FEATURES, "q4_k avx2": AVX2_FEATURES,
         "q6_k avx2": AVX2_FEATURES}


@pytest.mark.parametrize("name", MATRICES)
def test_every_kernel_gives_the_same_bits_for_any_x_chunk(name, monkeypatch):
    if missing_features(NEEDS.get(name, ())):
        pytest.skip(f"this CPU lacks {missing_features(NEEDS[name])}")
    w = MATRICES[name]()
    x = np.random.default_rng(7).standard_normal((45, K)).astype(np.float32)
    shipped = linear(x, w)
    for chunk_bytes in (1, 20 * K, 1 << 30):  # one register block a pass, a few blocks and a rest, the batch
        monkeypatch.setattr(models.linear, "linear_tiles", lambda b=chunk_bytes: LinearTiles(b, "test"))
        assert np.array_equal(linear(x, w), shipped), chunk_bytes


def fake_cpu(root, cpu_id: int, caches: list[tuple[str, str, str]]):
    for i, (level, kind, size) in enumerate(caches):
        index = root / f"cpu{cpu_id}" / "cache" / f"index{i}"
        index.mkdir(parents=True)
        for name, text in (("level", level), ("type", kind), ("size", size)):
            (index / name).write_text(text + "\n")


@pytest.mark.parametrize("size, nbytes", [("1024K", 1 << 20), ("2M", 2 << 20), ("256K", 256 << 10)])
def test_the_l2_size_is_read_from_sys(tmp_path, size, nbytes):
    cpu_id = min(os.sched_getaffinity(0))
    fake_cpu(tmp_path, cpu_id, [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", size),
                                ("3", "Unified", "32768K")])
    assert l2_cache(tmp_path) == (cpu_id, nbytes)


def test_without_an_l2_in_sys_the_default_is_used(tmp_path):
    assert l2_cache(tmp_path) is None
    tiles = linear_tiles(tmp_path)
    assert tiles.x_chunk_bytes == DEFAULT_L2_BYTES // 2 and "no L2" in tiles.why

