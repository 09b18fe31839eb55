"""Weight matrices: a matrix in one of the served formats (float32, float16, bfloat16, q8_0, q4_0, and
GGML's block formats q4_k, q5_k, q6_k, q4_1, q5_0, q5_1, iq4_nl, iq4_xs), packed for its activations or not
(memory/weights.py holds a model's weights built of them).

The packed cache stores these containers as they are (models/packed/tree.py): a change to the bytes a
packer writes must bump models/packed_cache.LAYOUT_VERSION, or starts would read entries of the old layout."""

from dataclasses import dataclass, replace
from itertools import pairwise

import gguf
import numpy as np

from cluster_configs.errors import CheckpointError
from kernels.formats.bf16 import to_bf16
from kernels.formats.ggml_blocks import (
    BLOCK_DTYPES,
    CODE,
    QK_K,
    row_values,
)
from kernels.formats.int8_layout import (
    GROUP,
    deinterleave_rows,
    pack_q4_0,
    pack_q8_0,
    pack_q8_0_quads,
    pad_scales,
    padded_k,
    unpack_int8_weights,
)
from kernels.formats.quant import QK, quantize_q4_0, quantize_q8_0
from kernels.formats.quantize_blocks import quantize_blocks
from kernels.placement import stream_zeros
from kernels.simd.bf16 import GROUP as BF16_GROUP
from kernels.simd.bf16 import ROWS as BF16_ROWS
from kernels.simd.bf16 import pack_bf16
from kernels.simd.cpu import missing_features
from kernels.simd.vnni import ROWS as VNNI_ROWS
from kernels.simd.vnni import VNNI_FEATURES
from memory.block_matrices import AVX2_DTYPES, KQuantMatrix, Q6KMatrix, int8_features, uses_vnni

WEIGHT_DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0") + BLOCK_DTYPES
# the format llama.cpp's llama-quant gives a matrix whose rows are not whole K-quant super-blocks of 256
K_QUANT_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl"}


@dataclass(frozen=True)
class WeightMatrix:
    """[out_features, in_features]; float16 as numpy float16 (a GGUF F16 tensor's or a float16 checkpoint's
    bits; numpy widens them exactly, and the kernels read the same bytes as int16: kernels/formats/fp16.py);
    bf16 as uint16 bits; q8_0 / q4_0 as GGML-valued blocks of 32; the GGML block formats
    (kernels/formats/ggml_blocks.py) as their GGUF bytes.

    data: f32 [N, K] | f16 [N, K] | uint16 [N, K] | int8 [N, K] | uint8 [N, K // 2] |
    uint8 [N, row_bytes(dtype, K)];
    scales: uint16 fp16 [N, K // 32] (q8_0, q4_0), else None.
    """

    dtype: str
    data: np.ndarray
    scales: np.ndarray | None = None

    @classmethod
    def from_float(cls, w: np.ndarray, dtype: str, importance: np.ndarray | None = None) -> "WeightMatrix":
        """w: [N, K] in dtype, quantized as llama.cpp quantizes: without an importance matrix, or with one
        (importance: f32 [G, K], G dividing N: each input column's mean squared activation, per group of
        N // G rows, an expert's; models/quantization/imatrix.py) in the formats that use it (q4_0, q4_1,
        q5_0, q5_1, the K-quants and the IQ4s; q8_0 and the float formats ignore it). Rows that are not whole
        super-blocks take K_QUANT_FALLBACK's format, rows that are not whole blocks of 32 bf16. float16 rounds
        to nearest even (float16 values keep their bits); a finite value beyond its range raises
        CheckpointError rather than becoming infinite."""
        if dtype == "float32":
            return cls(dtype, np.ascontiguousarray(w, dtype=np.float32))
        if dtype == "float16":
            with np.errstate(over="ignore"):
                data = np.ascontiguousarray(w, dtype=np.float16)
            overflow = w[np.isinf(data)]
            overflow = overflow[np.isfinite(overflow)]
            if len(overflow):
                raise CheckpointError(f"a weight of magnitude {np.abs(overflow).max():g} exceeds float16's "
                                      "largest value (65504); serve this model with weight_dtype='bfloat16' "
                                      "or 'float32'")
            return cls(dtype, data)
        if dtype in K_QUANT_FALLBACK and w.shape[1] % QK_K:
            dtype = K_QUANT_FALLBACK[dtype]
        if dtype == "bfloat16" or w.shape[1] % QK:
            return cls("bfloat16", to_bf16(w))  # rows that are not whole blocks stay bf16
        w = np.ascontiguousarray(w, dtype=np.float32)
        n, k = w.shape
        if importance is not None:
            importance = np.ascontiguousarray(importance, dtype=np.float32).reshape(-1, k)
            if n % importance.shape[0]:
                raise ValueError(f"{importance.shape[0]} importance groups do not divide {n} rows")
        if dtype in BLOCK_DTYPES or (importance is not None and dtype == "q4_0"):
            return cls.from_ggml_blocks(dtype, quantize_blocks(w, dtype, importance))
        scales = np.empty((n, k // QK), np.uint16)
        if dtype == "q8_0":
            qs = np.empty((n, k), np.int8)
            quantize_q8_0(w, qs, scales)
        else:
            qs = np.empty((n, k // 2), np.uint8)
            quantize_q4_0(w, qs, scales)
        return cls(dtype, qs, scales)

    @classmethod
    def from_ggml_blocks(cls, dtype: str, data: np.ndarray) -> "WeightMatrix":
        """A matrix from its rows as GGML stores them, uint8 [N, row bytes]: q8_0 / q4_0 blocks split into
        their scales and values, the block formats as they are."""
        if dtype not in ("q8_0", "q4_0"):
            return cls(dtype, data)
        n = data.shape[0]
        kind = gguf.GGMLQuantizationType.Q8_0 if dtype == "q8_0" else gguf.GGMLQuantizationType.Q4_0
        blocks = data.reshape(n, -1, gguf.GGML_QUANT_SIZES[kind][1])  # [N, K // 32, fp16 d + 32 | 16 bytes]
        scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(n, -1)
        qs = np.ascontiguousarray(blocks[:, :, 2:]).reshape(n, -1)
        return cls(dtype, qs.view(np.int8) if dtype == "q8_0" else qs, scales)

    def ggml_blocks(self) -> np.ndarray:
        """The rows as GGML stores them (from_ggml_blocks' inverse), uint8 [N, row bytes]: q8_0 / q4_0 blocks
        of (fp16 d, values), the block formats as they are; float formats as their bytes."""
        if self.scales is None:
            return np.ascontiguousarray(self.data).view(np.uint8)
        n, num_blocks = self.scales.shape
        scales = np.ascontiguousarray(self.scales).view(np.uint8).reshape(n, num_blocks, 2)
        qs = np.ascontiguousarray(self.data).view(np.uint8).reshape(n, num_blocks, -1)  # [N, K // 32, 32|16]
        return np.concatenate([scales, qs], axis=2).reshape(n, -1)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        if self.dtype in BLOCK_DTYPES:
            return n, row_values(self.dtype, k)
        return (n, k * 2) if self.dtype == "q4_0" else (n, k)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)


@dataclass(frozen=True)
class Int8Matrix:
    """A q8_0 / q4_0 matrix repacked for int8 activations (kernels/formats/int8_layout.py),
    [out_features, in_features].

    For the AVX2 kernels: data q8_0 int8 [N, Kp] in pair order | q4_0 uint8 [N, Kp // 2] in quad order; scales
    uint16 fp16 [N, Kp // 32]. For the VNNI kernel (vnni, kernels/simd/vnni.py): q8_0 as uint8 value + 128
    [N4, Kp] | q4_0 [N4, Kp // 2], both in quad order and in blocks of 4 interleaved rows
    (kernels/formats/int8_layout.py), scales [N4, Kp // 32]; N4 = N rounded up to 4, the padding rows zero. Kp
    = K padded to 256. vnni is chosen at packing when the host has it; both kernels give the same bits.
    activation_scale: a calibrated static scale for this matrix's inputs, 0 = per-block dynamic scales.
    """

    dtype: str
    data: np.ndarray
    scales: np.ndarray
    shape: tuple[int, int]
    activation_scale: float = 0.0
    vnni: bool = False

    @classmethod
    def pack(cls, w: WeightMatrix, activation_scale: float = 0.0, vnni: bool | None = None) -> "Int8Matrix":
        """vnni: None = whether the host has AVX512-VNNI (NUMASERVE_DISABLE_CPU_FEATURES hides it)."""
        if w.dtype not in ("q8_0", "q4_0"):
            raise ValueError(f"int8 activations need q8_0 or q4_0 weights, got {w.dtype}")
        vnni = host_has_vnni() if vnni is None else vnni
        n, k = w.shape
        kp = padded_k(k)
        rows = VNNI_ROWS if vnni else 1
        n4 = -(-n // rows) * rows
        if w.dtype == "q8_0" and vnni:
            data = stream_zeros((n4, kp), np.uint8)
            pack_q8_0_quads(w.data, data, rows)
        elif w.dtype == "q8_0":
            data = stream_zeros((n, kp), np.int8)
            pack_q8_0(w.data, data)
        else:
            data = stream_zeros((n4, kp // 2), np.uint8)
            pack_q4_0(w.data, data, rows)
        return cls(w.dtype, data, pad_scales(w.scales, kp, n4), (n, k), float(activation_scale), vnni)

    @property
    def activation_int_dtype(self) -> type:
        """The quantized activations' dtype: int8 in quad order, or int16 in pair order for the AVX2 q8_0
        kernel."""
        return np.int16 if self.data.dtype == np.int8 else np.int8

    def repacked(self, w: WeightMatrix) -> "Int8Matrix":
        """w (of this matrix's dtype) packed as this one is: its kernel and activation scale."""
        return Int8Matrix.pack(w, self.activation_scale, self.vnni)

    def unpack(self) -> WeightMatrix:
        """The same values in the GGML layout (export, tests)."""
        n, k = self.shape
        data = (deinterleave_rows(self.data, VNNI_ROWS, _group_bytes(self.dtype), n)
                if self.vnni else self.data)
        values = np.empty((n, k), np.int8)
        unpack_int8_weights(data, self.dtype == "q4_0", data.dtype == np.uint8, k, values)
        scales = np.ascontiguousarray(self.scales[:n, :k // QK])
        if self.dtype == "q8_0":
            return WeightMatrix("q8_0", values, scales)
        nibbles = (values.reshape(n, k // QK, QK).astype(np.int16) + 8).astype(np.uint8)
        packed = nibbles[:, :, :16] | (nibbles[:, :, 16:] << 4)
        return WeightMatrix("q4_0", np.ascontiguousarray(packed.reshape(n, k // 2)), scales)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes


@dataclass(frozen=True)
class Bf16Matrix:
    """A bf16 matrix packed for bf16 activations (kernels/simd/bf16.py), [out_features, in_features]: data
    uint16 [N4, Kp] row-major, N4 = N rounded up to 4 (the kernel's blocks of rows) and Kp = K rounded up to
    128, the padding zero."""

    data: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def pack(cls, w: WeightMatrix) -> "Bf16Matrix":
        if w.dtype != "bfloat16":
            raise ValueError(f"bf16 activations need bfloat16 weights, got {w.dtype}")
        n, k = w.shape
        data = stream_zeros((-(-n // BF16_ROWS) * BF16_ROWS, -(-k // BF16_GROUP) * BF16_GROUP), np.uint16)
        pack_bf16(w.data, data)
        return cls(data, (n, k))

    def unpack(self) -> WeightMatrix:
        n, k = self.shape
        return WeightMatrix("bfloat16", self.data[:n, :k].copy())

    def repacked(self, w: WeightMatrix) -> "Bf16Matrix":
        return Bf16Matrix.pack(w)

    @property
    def dtype(self) -> str:
        return "bfloat16"

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class BlockInt8Matrix:
    """A matrix in a GGML block format (q4_k, q5_k, q6_k, q4_1, q5_0, q5_1, iq4_nl, iq4_xs) repacked for int8
    activations, [out_features, in_features]: Q6_K for its own kernel (kernels/formats/q6k_layout.py,
    kernels/linear/q6k.py), the others for kernels/linear/kquant.py; through AVX512-VNNI (vnni), else
    AVX2's kernels (block_matrices.AVX2_DTYPES): one layout, the same bits. The activations are Int8Matrix's
    VNNI ones (quad order, K padded to 256), so one quantized input serves every format of a layer.
    activation_scale: a calibrated static scale for its inputs, 0 = per-block dynamic scales."""

    dtype: str
    packed: "KQuantMatrix | Q6KMatrix"
    activation_scale: float = 0.0
    vnni: bool | None = None  # None: block_matrices.uses_vnni(dtype)

    def __post_init__(self):
        if self.vnni is None:
            object.__setattr__(self, "vnni", uses_vnni(self.dtype))
        if not self.vnni and self.dtype not in AVX2_DTYPES:
            raise ValueError(f"{self.dtype} has no AVX2 int8 kernel: only {AVX2_DTYPES}")

    @classmethod
    def pack(cls, w: WeightMatrix, activation_scale: float = 0.0,
             vnni: bool | None = None) -> "BlockInt8Matrix":
        """vnni: None = block_matrices.uses_vnni(w.dtype)."""
        if w.dtype not in BLOCK_DTYPES:
            raise ValueError(f"BlockInt8Matrix packs the GGML block formats {BLOCK_DTYPES}, got {w.dtype}")
        packed = (Q6KMatrix.pack(w.data, w.shape) if w.dtype == "q6_k"
                  else KQuantMatrix.pack(w.data, CODE[w.dtype], w.shape[1]))
        return cls(w.dtype, packed, float(activation_scale), vnni)

    features = staticmethod(int8_features)  # dtype -> the CPU features its slowest kernel needs

    @property
    def shape(self) -> tuple[int, int]:
        return self.packed.shape

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    @property
    def activation_int_dtype(self) -> type:
        return np.int8

    def unpack(self) -> WeightMatrix:
        """The GGUF blocks, bit for bit those packed."""
        return WeightMatrix(self.dtype, self.packed.unpack())

    def repacked(self, w: WeightMatrix) -> "BlockInt8Matrix":
        return BlockInt8Matrix.pack(w, self.activation_scale, self.vnni)


@dataclass(frozen=True)
class StackedMatrix:
    """One matrix whose row blocks keep different formats, [sum of the parts' rows, in_features]: a GGUF
    file's attn_q, attn_k and attn_v in Q4_K, Q4_K and Q6_K served as the fused qkv without requantizing
    any of them. Its outputs are the parts' outputs side by side (models/linear.py)."""

    parts: tuple["WeightMatrix | Int8Matrix | Bf16Matrix | BlockInt8Matrix", ...]

    def __post_init__(self):
        if len(self.parts) < 2 or len({p.shape[1] for p in self.parts}) != 1:
            raise ValueError("a StackedMatrix stacks two or more matrices of one in_features")

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def dtype(self) -> str:
        return "+".join(dict.fromkeys(p.dtype for p in self.parts))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def row_ranges(self) -> list[tuple[int, int]]:
        """Each part's rows [start, stop) in the stacked matrix."""
        bounds = np.cumsum([0] + [p.shape[0] for p in self.parts])
        return [(int(a), int(b)) for a, b in pairwise(bounds)]


# a served matrix, packed for its activations or not
Matrix = WeightMatrix | Int8Matrix | Bf16Matrix | BlockInt8Matrix | StackedMatrix


def map_parts(w: Matrix, f) -> Matrix:
    """f applied to w, or to each part of a StackedMatrix (stacked again)."""
    return StackedMatrix(tuple(f(p) for p in w.parts)) if isinstance(w, StackedMatrix) else f(w)


def parts(w: Matrix) -> tuple:
    """w's parts (a StackedMatrix's), or w alone."""
    return w.parts if isinstance(w, StackedMatrix) else (w,)


def stacked(parts: list[WeightMatrix]) -> Matrix:
    """Row blocks as one matrix: consecutive blocks of one format concatenated, and a StackedMatrix of the
    runs where formats differ."""
    runs: list[list[WeightMatrix]] = []
    for p in parts:
        if runs and runs[-1][0].dtype == p.dtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    joined = [run[0] if len(run) == 1 else WeightMatrix(
        run[0].dtype, np.concatenate([p.data for p in run]),
        None if run[0].scales is None else np.concatenate([p.scales for p in run])) for run in runs]
    return joined[0] if len(joined) == 1 else StackedMatrix(tuple(joined))


def host_has_vnni() -> bool:
    return not missing_features(VNNI_FEATURES)


def _group_bytes(dtype: str) -> int:
    """A packed row's bytes per group of 256 values."""
    return GROUP // 2 if dtype == "q4_0" else GROUP


def select_rows(w: Matrix, ids: np.ndarray) -> Matrix:
    """The matrix of w's rows ids [n] (in that order), in w's format and layout."""
    if isinstance(w, StackedMatrix):
        raise TypeError("select_rows of a StackedMatrix: its parts' formats differ; dequantize it first")
    if isinstance(w, (Int8Matrix, Bf16Matrix, BlockInt8Matrix)):
        return w.repacked(select_rows(w.unpack(), ids))
    return WeightMatrix(w.dtype, np.ascontiguousarray(w.data[ids]),
                        None if w.scales is None else np.ascontiguousarray(w.scales[ids]))


def row_block(w: Matrix, start: int, stop: int) -> Matrix:
    """Rows [start, stop) of w as a zero-copy view in w's format and layout (a MoE expert's block of a
    stacked matrix). Packed formats are read in blocks of 4 rows (Bf16Matrix, a VNNI Int8Matrix; the latter
    interleaves them): start must begin a block and stop end one or be the last row, else ValueError."""
    n, k = w.shape
    if not 0 <= start < stop <= n:
        raise ValueError(f"rows [{start}, {stop}) are not a block of a matrix of {n} rows")
    if isinstance(w, WeightMatrix):
        return WeightMatrix(w.dtype, w.data[start:stop], None if w.scales is None else w.scales[start:stop])
    if isinstance(w, StackedMatrix):
        raise TypeError("row_block of a StackedMatrix: stack experts of one format")
    if isinstance(w, Bf16Matrix):
        rows = BF16_ROWS
    else:
        rows = VNNI_ROWS if isinstance(w, BlockInt8Matrix) or w.vnni else 1
    if start % rows or (stop % rows and stop != n):
        raise ValueError(f"rows [{start}, {stop}) split a block of {rows} interleaved rows")
    end = -(-stop // rows) * rows  # the last block's padding rows come along
    if isinstance(w, Bf16Matrix):
        return Bf16Matrix(w.data[start:end], (stop - start, k))
    if isinstance(w, BlockInt8Matrix):  # both layouts keep a block of 4 rows' stream in its 4 rows
        p = w.packed
        extra = {"d": p.d[start:end]} if isinstance(p, Q6KMatrix) else {}
        return replace(w, packed=replace(p, data=p.data[start:end], shape=(stop - start, k), **extra))
    return replace(w, data=w.data[start:end], scales=w.scales[start:end], shape=(stop - start, k))
