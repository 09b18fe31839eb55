"""Weight containers: a matrix in one of the served formats (float32, bfloat16, q8_0, q4_0)."""

from dataclasses import dataclass

import numpy as np

from kernels.bf16 import to_bf16
from kernels.quant import QK, quantize_q4_0, quantize_q8_0

WEIGHT_DTYPES = ("float32", "bfloat16", "q8_0", "q4_0")


@dataclass(frozen=True)
class WeightMatrix:
    """[out_features, in_features]; bf16 as uint16 bits; q8_0 / q4_0 as GGML-valued blocks of 32.

    data: f32 [N, K] | uint16 [N, K] | int8 [N, K] | uint8 [N, K // 2]; scales: uint16 fp16 [N, K // 32].
    """

    dtype: str
    data: np.ndarray
    scales: np.ndarray | None = None

    @classmethod
    def from_float(cls, w: np.ndarray, dtype: str) -> "WeightMatrix":
        if dtype == "float32":
            return cls(dtype, np.ascontiguousarray(w, dtype=np.float32))
        if dtype == "bfloat16" or w.shape[1] % QK:
            return cls("bfloat16", to_bf16(w))  # rows that are not whole blocks stay bf16
        w = np.ascontiguousarray(w, dtype=np.float32)
        n, k = w.shape
        scales = np.empty((n, k // QK), np.uint16)
        if dtype == "q8_0":
            qs = np.empty((n, k), np.int8)
            quantize_q8_0(w, qs, scales)
        else:
            qs = np.empty((n, k // 2), np.uint8)
            quantize_q4_0(w, qs, scales)
        return cls(dtype, qs, scales)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return (n, k * 2) if self.dtype == "q4_0" else (n, k)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (0 if self.scales is None else self.scales.nbytes)
