"""Weight containers: a matrix in one of the served formats, and a row-gather embedding table."""

from dataclasses import dataclass

import numpy as np

from kernels.bf16 import from_bf16, to_bf16

WEIGHT_STORAGE = {"float32": np.float32, "bfloat16": np.uint16}


@dataclass(frozen=True)
class WeightMatrix:
    """[out_features, in_features] in `dtype`; bf16 is kept as uint16 bit patterns."""

    dtype: str
    data: np.ndarray

    @classmethod
    def from_float(cls, w: np.ndarray, dtype: str) -> "WeightMatrix":
        if dtype == "bfloat16":
            return cls(dtype, to_bf16(w))
        return cls(dtype, np.ascontiguousarray(w, dtype=np.float32))

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def to_float32(self) -> np.ndarray:
        return from_bf16(self.data) if self.dtype == "bfloat16" else self.data
