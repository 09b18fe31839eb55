"""The GGML block formats' matrices as their int8-activation kernels read them: KQuantMatrix (Q4_K, Q5_K,
Q4_1, Q5_0, Q5_1; kernels/formats/kquant_layout.py's tiles) and Q6KMatrix (kernels/formats/q6k_layout.py's
blocks). Each packs a GGUF tensor's raw blocks and unpacks them bit for bit; the layouts and their packers are
kernels'."""

from dataclasses import dataclass

import numpy as np

from kernels.formats.ggml_blocks import BLOCK_DTYPES, CODE
from kernels.formats.int8_layout import GROUP
from kernels.formats.kquant_layout import pack_kquant, unpack_kquant
from kernels.formats.q6k_layout import RAW_BYTES, ROW_BYTES, ROWS, pack_q6k, unpack_q6k
from kernels.placement import stream_zeros
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from kernels.simd.kquant import AVX2_FORMATS
from kernels.simd.q6k import Q6K_FEATURES
from kernels.simd.vnni import VNNI_FEATURES

# the block formats with an AVX2 int8 kernel (matmul_kquant_avx2, matmul_q6k_avx2): all but IQ4's
AVX2_DTYPES = tuple(d for d in BLOCK_DTYPES if CODE[d] in AVX2_FORMATS or d == "q6_k")


def uses_vnni(dtype: str) -> bool:
    """Whether the host has the features of block format dtype's VNNI kernel (NUMASERVE_DISABLE_CPU_FEATURES
    hides them): the kernel its matrices are packed for, else AVX2's."""
    return not missing_features(Q6K_FEATURES if dtype == "q6_k" else VNNI_FEATURES)


def int8_features(dtype: str) -> tuple[str, ...]:
    """The CPU features the slowest int8 kernel of block format dtype needs."""
    return AVX2_FEATURES if dtype in AVX2_DTYPES else VNNI_FEATURES


@dataclass(frozen=True)
class KQuantMatrix:
    """A Q4_K / Q5_K / Q4_1 / Q5_0 / Q5_1 matrix [N, K] packed for kernels/linear/kquant.py: data uint8
    [N4, Kp // 256 * tile_bytes // 4] (kernels/formats/kquant_layout.py); qtype the GGML type id
    (ggml_blocks.CODE[dtype])."""

    qtype: int
    data: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def pack(cls, raw: np.ndarray, qtype: int, k: int) -> "KQuantMatrix":
        """raw: the GGML blocks as in a GGUF file, uint8 [N, K // block_values * block_bytes]."""
        return cls(int(qtype), pack_kquant(raw, int(qtype), k), (raw.shape[0], k))

    def unpack(self) -> np.ndarray:
        """The raw GGML blocks, uint8 [N, K // block_values * block_bytes], bit for bit those packed."""
        return unpack_kquant(self.data, self.qtype, *self.shape)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes


@dataclass(frozen=True)
class Q6KMatrix:
    """A Q6_K matrix [N, K] in kernels/formats/q6k_layout.py's layout: data uint8 [N4, K // 256 * 208], d
    uint16 [N4, K // 256]."""

    data: np.ndarray
    d: np.ndarray
    shape: tuple[int, int]

    @classmethod
    def pack(cls, raw: np.ndarray, shape: tuple[int, int]) -> "Q6KMatrix":
        """raw: uint8 [N, K // 256 * 210], the GGUF tensor's bytes row by row."""
        n, k = shape
        if k % GROUP or raw.shape != (n, k // GROUP * RAW_BYTES) or raw.dtype != np.uint8:
            raise ValueError(f"Q6_K [{n}, {k}] needs uint8 [{n}, {k // GROUP * RAW_BYTES}], got {raw.dtype} "
                             f"{list(raw.shape)}")
        n4 = -(-n // ROWS) * ROWS
        data = stream_zeros((n4, k // GROUP * ROW_BYTES), np.uint8)
        d = np.zeros((n4, k // GROUP), np.uint16)
        pack_q6k(np.ascontiguousarray(raw), data, d)
        return cls(data, d, (n, k))

    def unpack(self) -> np.ndarray:
        """The raw GGUF bytes: uint8 [N, K // 256 * 210]."""
        n, k = self.shape
        raw = np.empty((n, k // GROUP * RAW_BYTES), np.uint8)
        unpack_q6k(self.data, self.d, raw)
        return raw

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.d.nbytes
