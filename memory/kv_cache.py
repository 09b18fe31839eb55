"""KV storage of one engine: per layer [num_blocks, block_size, n_kv_heads, head_dim] arrays, each layer in
its own dtype (memory/kv_formats.py), and the recent window's bfloat16 shadows of the blocks that carry one
(layers of a format with a window; shadow_of maps a block to its shadow, -1: none). Its KVLayout (geometry,
formats, sizes) is known without the arrays: the block bookkeeping reads that alone."""

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from kernels.attention.chunks import NO_WINDOW, RecentWindow
from memory.heap import untouched_zeros
from memory.kv_formats import KV_FORMATS, RECENT_GROUP, KVFormat


def layer_kv_dtypes(num_layers: int, kv_dtype: str, overrides: Mapping[int, str] | None = None) -> list[str]:
    """Each layer's KV dtype: kv_dtype, except the layers overrides names."""
    overrides = overrides or {}
    outside = sorted(i for i in overrides if not 0 <= i < num_layers)
    if outside:
        raise ValueError(f"kv_dtype_overrides names layers {outside}, but the model has {num_layers} layers "
                         f"(0 to {num_layers - 1})")
    return [overrides.get(i, kv_dtype) for i in range(num_layers)]


def kv_bytes_per_token(num_layers: int, n_kv_heads: int, head_dim: int, kv_dtype: str,
                       overrides: Mapping[int, str] | None = None) -> int:
    """Bytes of one token's keys and values over every layer, scales included."""
    return 2 * n_kv_heads * sum(KV_FORMATS[d].row_bytes(head_dim)
                                for d in layer_kv_dtypes(num_layers, kv_dtype, overrides))


@dataclass(frozen=True)
class KVLayout:
    """A KV cache's geometry and per-layer formats: what KVCache allocates, and all the scheduler's block
    bookkeeping reads of it (so a simulated engine builds one without arrays)."""

    num_layers: int
    num_blocks: int
    block_size: int
    n_kv_heads: int
    head_dim: int
    layer_dtypes: tuple[str, ...]
    num_shadows: int  # blocks that can carry a recent-window shadow at once (0: no layer keeps a window)
    bytes_per_token: int  # one token's keys and values over every layer, scales included

    @property
    def formats(self) -> tuple[KVFormat, ...]:
        return tuple(KV_FORMATS[d] for d in self.layer_dtypes)

    @property
    def windowed(self) -> bool:
        return self.num_shadows > 0

    @property
    def window_bytes(self) -> int:
        """The recent window's bfloat16 shadows (keys and values of each windowed layer), outside the pool."""
        num_recent = sum(f.recent for f in self.formats)
        return 2 * num_recent * self.num_shadows * self.block_size * self.n_kv_heads * self.head_dim * 2


def kv_layout(num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
              kv_dtype: str, overrides: Mapping[int, str] | None = None, num_shadows: int = 0) -> KVLayout:
    """The layout of a KV cache, checked (layer overrides, head_dim against each format); num_shadows counts
    only when a layer's format keeps a recent window."""
    layer_dtypes = tuple(layer_kv_dtypes(num_layers, kv_dtype, overrides))
    for name in set(layer_dtypes):
        KV_FORMATS[name].check_head_dim(head_dim)
    windowed = num_shadows > 0 and any(KV_FORMATS[d].recent for d in layer_dtypes)
    return KVLayout(num_layers, num_blocks, block_size, n_kv_heads, head_dim, layer_dtypes,
                    num_shadows if windowed else 0,
                    kv_bytes_per_token(num_layers, n_kv_heads, head_dim, kv_dtype, overrides))


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 kv_dtype: str, overrides: Mapping[int, str] | None = None, num_shadows: int = 0):
        """num_shadows: blocks that can carry a recent-window shadow at once (0: no window, every layer read
        from its codes alone)."""
        self.layout = layout = kv_layout(num_layers, num_blocks, block_size, n_kv_heads, head_dim, kv_dtype,
                                         overrides, num_shadows)
        self.layer_dtypes = list(layout.layer_dtypes)
        self.formats: list[KVFormat] = list(layout.formats)
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, n_kv_heads)
        # pages taken as blocks are first written, by the pinned worker's threads (NUMA-local, first touch)
        self.k = [untouched_zeros((*shape, f.row_elements(head_dim)), f.storage) for f in self.formats]
        self.v = [untouched_zeros((*shape, f.row_elements(head_dim)), f.storage) for f in self.formats]
        # [num_blocks, block_size, n_kv] float32 per layer ([1, 1, 1] unread where a format has no scale)
        scale_shapes = [shape if f.has_scale else (1, 1, 1) for f in self.formats]
        self.k_scale = [untouched_zeros(s, np.float32) for s in scale_shapes]
        self.v_scale = [untouched_zeros(s, np.float32) for s in scale_shapes]
        self.bytes_per_token = layout.bytes_per_token
        self.windowed = layout.windowed
        num_shadows = layout.num_shadows
        # [num_shadows, block_size, n_kv, head_dim] bfloat16 bits per windowed layer
        wide_shape = (num_shadows, block_size, n_kv_heads, head_dim) if self.windowed else (1, 1, 1, 1)
        self.k_wide = [untouched_zeros(wide_shape, np.uint16) if f.recent else None for f in self.formats]
        self.v_wide = [untouched_zeros(wide_shape, np.uint16) if f.recent else None for f in self.formats]
        self.shadow_of = np.full(num_blocks, -1, np.int32)  # [num_blocks]
        self.free_shadows = list(range(num_shadows - 1, -1, -1))

    def window(self, i: int, wide_from: np.ndarray) -> RecentWindow:
        """Layer i's recent window for kernels/attention.paged_attention; wide_from [S] int32."""
        if not self.windowed or self.k_wide[i] is None:
            return NO_WINDOW
        return RecentWindow(self.k_wide[i], self.v_wide[i], self.shadow_of, wide_from, RECENT_GROUP)

    @property
    def window_bytes(self) -> int:
        return self.layout.window_bytes

    def attach_shadow(self, block: int) -> None:
        if self.shadow_of[block] >= 0 or not self.free_shadows:
            raise RuntimeError(f"block {block} has a recent-window shadow already, or none is left (the "
                               "engine sizes them for max_num_seqs requests and max_num_batched_tokens new "
                               "tokens a step): a bug")
        self.shadow_of[block] = self.free_shadows.pop()

    def release_shadow(self, block: int) -> None:
        self.free_shadows.append(int(self.shadow_of[block]))
        self.shadow_of[block] = -1

    @property
    def arrays(self) -> list[np.ndarray]:
        return [*self.k, *self.v, *self.k_scale, *self.v_scale]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def block_parts(self, block: int) -> list[np.ndarray]:
        """Views of one block's codes and scales, layer by layer, keys then values (a disk tier's file
        payload, in this order): [block_size, n_kv, row] codes, [block_size, n_kv] scales where the format has
        one."""
        parts = []
        for i, fmt in enumerate(self.formats):
            parts += [self.k[i][block], self.v[i][block]]
            if fmt.has_scale:
                parts += [self.k_scale[i][block], self.v_scale[i][block]]
        return parts

    def move_slots(self, block_ids: list[int], src: list[int], dst: list[int]) -> None:
        """For every layer, the KV (and scales) of a sequence's slot src[i] copied to its slot dst[i], in
        order (a tree verification keeps its accepted path: each dst <= its src, so no copy reads a slot
        written before it). Slots are indices into the sequence, mapped through its block_ids."""
        bs = self.block_size
        for a, b in zip(src, dst):
            if a != b:
                ab, ao, bb, bo = block_ids[a // bs], a % bs, block_ids[b // bs], b % bs
                for i, fmt in enumerate(self.formats):
                    self.k[i][bb, bo] = self.k[i][ab, ao]
                    self.v[i][bb, bo] = self.v[i][ab, ao]
                    if fmt.has_scale:
                        self.k_scale[i][bb, bo] = self.k_scale[i][ab, ao]
                        self.v_scale[i][bb, bo] = self.v_scale[i][ab, ao]
                    if self.k_wide[i] is not None and min(self.shadow_of[ab], self.shadow_of[bb]) >= 0:
                        sa, sb = self.shadow_of[ab], self.shadow_of[bb]
                        self.k_wide[i][sb, bo] = self.k_wide[i][sa, ao]
                        self.v_wide[i][sb, bo] = self.v_wide[i][sa, ao]
