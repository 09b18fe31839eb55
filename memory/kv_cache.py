"""KV storage of one engine: per layer [num_blocks, block_size, n_kv_heads, head_dim] arrays."""

import numpy as np

from memory.heap import untouched_zeros

KV_STORAGE = {"float32": np.float32, "bfloat16": np.uint16, "int8": np.int8}


def kv_bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    elem = np.dtype(KV_STORAGE[kv_dtype]).itemsize
    scales = 4 if kv_dtype == "int8" else 0  # one float32 scale per (token, kv head)
    return 2 * num_layers * n_kv_heads * (head_dim * elem + scales)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 kv_dtype: str):
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, num_blocks, block_size, n_kv_heads, head_dim)
        # pages taken as blocks are first written, by the pinned worker's threads (NUMA-local, first touch)
        self.k = untouched_zeros(shape, KV_STORAGE[kv_dtype])  # [L, num_blocks, block_size, n_kv, D]
        self.v = untouched_zeros(shape, KV_STORAGE[kv_dtype])
        scale_shape = shape[:-1] if kv_dtype == "int8" else (num_layers, 1, 1, 1)
        self.k_scale = untouched_zeros(scale_shape, np.float32)  # [L, num_blocks, block_size, n_kv]
        self.v_scale = untouched_zeros(scale_shape, np.float32)
        self.bytes_per_token = kv_bytes_per_token(num_layers, n_kv_heads, head_dim, kv_dtype)

    @property
    def has_scale(self) -> bool:
        return self.kv_dtype == "int8"

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.k_scale.nbytes + self.v_scale.nbytes

    def move_slots(self, block_ids: list[int], src: list[int], dst: list[int]) -> None:
        """For every layer, the KV (and scales) of a sequence's slot src[i] copied to its slot dst[i], in
        order (a tree verification keeps its accepted path: each dst <= its src, so no copy reads a slot
        written before it). Slots are indices into the sequence, mapped through its block_ids."""
        bs = self.block_size
        for a, b in zip(src, dst):
            if a != b:
                ab, ao, bb, bo = block_ids[a // bs], a % bs, block_ids[b // bs], b % bs
                self.k[:, bb, bo] = self.k[:, ab, ao]
                self.v[:, bb, bo] = self.v[:, ab, ao]
                if self.has_scale:
                    self.k_scale[:, bb, bo] = self.k_scale[:, ab, ao]
                    self.v_scale[:, bb, bo] = self.v_scale[:, ab, ao]
