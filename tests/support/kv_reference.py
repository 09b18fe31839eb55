"""What a KV cache of each dtype holds, decoded in numpy (torch's float8 types for fp8) to float64 in the
model's basis (rotated forms rotated back by Sylvester's Hadamard matrix)."""

import numpy as np
import torch

from kernels.attention.gauss4 import GAUSS4_LEVELS
from kernels.attention.score_noise import GAUSS4_KAPPA
from kernels.formats.bf16 import from_bf16
from memory.kv_formats import KV_FORMATS

KV_DTYPES = list(KV_FORMATS)
TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def sylvester(n: int) -> np.ndarray:
    """The normalized Hadamard matrix of order n (a power of two), float64."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def head_dim_for(kv_dtype: str) -> int:
    return 32 if kv_dtype.endswith("_hadamard") else 24  # 24: a row that is not a whole number of vectors


def stored(kv_dtype: str, cache: np.ndarray, scales: np.ndarray, head_dim: int) -> np.ndarray:
    """cache [num_blocks, block_size, n_kv, elements], scales [num_blocks, block_size, n_kv] -> float64
    [num_blocks * block_size, n_kv, head_dim]."""
    fmt = KV_FORMATS[kv_dtype]
    if kv_dtype == "bfloat16":
        values = from_bf16(cache).astype(np.float64)
    elif kv_dtype in TORCH_FP8:
        values = torch.from_numpy(cache).view(TORCH_FP8[kv_dtype]).to(torch.float64).numpy()
    elif fmt.values_per_element == 2:
        codes = np.stack([cache & 15, cache >> 4], axis=-1).reshape(*cache.shape[:-1], head_dim)
        values = GAUSS4_LEVELS.astype(np.float64)[codes] if fmt.codebook else codes - 8.0
    else:
        values = cache.astype(np.float64)
    if fmt.has_scale:
        values = values * scales[..., None]
    if fmt.rotated:
        values = values @ sylvester(head_dim)
    return values.reshape(-1, cache.shape[2], head_dim)


def score_noise(kv_dtype: str, scales: np.ndarray, head_dim: int) -> np.ndarray:
    """The variance of a key row's score error per unit of softmax_scale^2 |q|^2 (the kernels take half of it
    off each score: kernels/attention/score_noise.py), [num_blocks, block_size, n_kv] -> float64
    [num_blocks * block_size, n_kv]; 0 for the formats whose scores are not corrected."""
    kappas = {"int4": (head_dim - 1) / (12 * head_dim), "int4_hadamard": float(GAUSS4_KAPPA)}
    kappa = kappas.get(kv_dtype, 0.0)
    return kappa * scales.astype(np.float64).reshape(-1, scales.shape[2]) ** 2


def empty_cache(kv_dtype: str, num_blocks: int, block_size: int, n_kv: int, head_dim: int):
    """(k_cache, v_cache, k_scale, v_scale) of one layer."""
    fmt = KV_FORMATS[kv_dtype]
    shape = (num_blocks, block_size, n_kv, fmt.row_elements(head_dim))
    return (np.zeros(shape, fmt.storage), np.zeros(shape, fmt.storage),
            np.ones(shape[:3], np.float32), np.ones(shape[:3], np.float32))
