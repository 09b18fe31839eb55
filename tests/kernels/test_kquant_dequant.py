"""The GGML block formats as WeightMatrix: dequantized values bit-equal to the gguf package's for any bytes,
embedding rows, and the matrix geometry (shape, nbytes, select_rows, row_block) from the block table."""

import gguf
import numpy as np
import pytest

from kernels.formats.ggml_blocks import BLOCK_DTYPES, GGML_TYPE, row_bytes
from memory.matrices import WeightMatrix, row_block, select_rows
from models.linear import dequantize, embed


def random_blocks(dtype: str, n: int, k: int, seed: int = 0) -> WeightMatrix:
    """Any bytes: every bit pattern of scales, mins and quants (fp16 NaN and inf included)."""
    rng = np.random.default_rng(seed)
    return WeightMatrix(dtype, rng.integers(0, 256, (n, row_bytes(dtype, k)), dtype=np.uint8))


def fp16_bytes(value: float) -> list[int]:
    return list(np.array([value], np.float16).view(np.uint8))


def edge_blocks(dtype: str) -> WeightMatrix:
    """One block per row: all zero; all bytes 0xff (largest 6-bit scales and mins, negative NaN d); largest
    scales and mins with negative d and dmin, or Q6_K's int8 scales at -128 .. -1; and with positive ones."""
    size = row_bytes(dtype, 256)
    rows = np.zeros((4, size), np.uint8)
    rows[1] = 255
    rows[2:] = np.random.default_rng(1).integers(0, 256, (2, size), dtype=np.uint8)
    for row, sign in ((rows[2], -1), (rows[3], 1)):
        if dtype == "q6_k":
            row[192:208] = np.arange(-128, -112).astype(np.int8).view(np.uint8) if sign < 0 else 127
            row[208:210] = fp16_bytes(sign * 0.5)
            continue
        blocks = row.reshape(-1, size * 32 // 256 if dtype in ("q4_1", "q5_0", "q5_1") else size)
        blocks[:, 0:2] = fp16_bytes(sign * 1.5)
        if dtype != "q5_0":
            blocks[:, 2:4] = fp16_bytes(sign * 2.0 ** -14)  # the smallest normal fp16
        if dtype in ("q4_k", "q5_k"):
            blocks[:, 4:16] = 255  # every sub-block's scale and min at 63
    return WeightMatrix(dtype, rows)


def gguf_values(w: WeightMatrix) -> np.ndarray:
    return gguf.quants.dequantize(w.data, GGML_TYPE[w.dtype])


def bit_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """The same float32 bits, where both are NaN any NaN (which operand's payload survives d * q + m when d
    and m are both NaN is up to the instruction order)."""
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # gguf's arithmetic on NaN scales
@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
@pytest.mark.parametrize("make", [lambda d: random_blocks(d, 40, 512), edge_blocks], ids=["random", "edges"])
def test_dequantized_bits_equal_the_gguf_packages(dtype, make):
    w = make(dtype)
    assert bit_equal(dequantize(w), gguf_values(w))


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_quantized_matrix_dequantizes_to_the_gguf_packages_values(dtype):
    w = WeightMatrix.from_float(np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32), dtype)
    assert w.data.shape == (8, row_bytes(dtype, 512)) and w.scales is None
    assert np.array_equal(dequantize(w), gguf_values(w))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")
@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_embedding_rows_are_the_dequantized_rows(dtype):
    w = random_blocks(dtype, 20, 256)
    ids = np.array([5, 0, 19, 5])
    assert bit_equal(embed(w, ids), dequantize(w)[ids])


@pytest.mark.parametrize("dtype", BLOCK_DTYPES)
def test_geometry_comes_from_the_block_table(dtype):
    w = random_blocks(dtype, 12, 768)
    size, type_size = gguf.GGML_QUANT_SIZES[GGML_TYPE[dtype]]
    assert w.shape == (12, 768) and w.nbytes == 12 * 768 // size * type_size
    picked = select_rows(w, np.array([3, 11, 3]))
    assert picked.dtype == dtype and np.array_equal(picked.data, w.data[[3, 11, 3]])
    block = row_block(w, 4, 9)
    assert block.shape == (5, 768) and np.shares_memory(block.data, w.data)
    assert bit_equal(dequantize(block), dequantize(w)[4:9])


def test_rows_of_partial_blocks_are_refused():
    with pytest.raises(ValueError, match="whole blocks of 256"):
        row_bytes("q6_k", 320)
