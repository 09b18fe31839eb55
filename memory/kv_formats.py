"""The KV dtypes: how each stores a row of head_dim values, and the one write / attend pair per layer.

bytes a value (D = head_dim; a scale is one float32 per (slot, kv head) row):
  float32 4, bfloat16 2, int8 and int8_hadamard 1 + 4 / D, fp8_e4m3 and fp8_e5m2 1 + 4 / D,
  int4 and int4_hadamard 1/2 + 4 / D.
The *_hadamard forms rotate keys and values (kernels/attention/hadamard.py) before quantizing, the queries the
same way, and the attention output back; the kernel itself reads every form as codes x per-row scale. Values
are rotated too: on the demo model rotating only the keys measured no better than rotating both; at 8 bits
neither rotation helps, so int8_hadamard is kept only as the issue's form (benchmarks/results/HISTORY.md).
int4_hadamard's codes index a 16-level codebook for Gaussian coordinates with a fitted scale
(kernels/attention/gauss4.py), which the rotation makes apt whatever the model; plain int4 keeps the uniform
-7..7 grid at max|x| / 7. The rotation alone bought nothing on the demo model (its rows have no outliers to
spread, and its values are lighter-tailed than a Gaussian, so rotated they round coarser); with the codebook
the next-token distributions are half as far from bfloat16 KV's (benchmarks/results/kv_quality.json).

The fp8 forms keep a recent window: each token reads its own group of RECENT_GROUP positions and the one
before (its 16 to 31 newest slots) from a bfloat16 shadow of their blocks (kernels/attention/chunks.py; the
engine gives shadows to those blocks only, scheduling/kv_cache_manager.py). Without it e4m3 changed some of
bfloat16 KV's greedy continuations on the demo model's held-out prompts (benchmarks/results/HISTORY.md): a
near tie at a step is decided by the newest keys' scores, which 3 mantissa bits (2.4% RMS) tip; with the
window none did.
"""

from dataclasses import dataclass

import numpy as np

from kernels.attention.chunks import NO_WINDOW
from kernels.attention.gauss4 import GAUSS4
from kernels.attention.hadamard import hadamard_inplace, is_power_of_two
from kernels.attention.kv_quant import FP8, INT4, INT8, write_kv, write_kv_scaled, write_kv_shadows
from kernels.attention.paged import paged_attention
from kernels.formats.fp8 import E4M3, E5M2

RECENT_GROUP = 16  # positions a group of the recent window (kernels/attention_chunks.recent_start)


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: type  # numpy dtype of the cache arrays
    values_per_element: int  # 2: two int4 codes a byte
    has_scale: bool
    rotated: bool
    fp8: tuple[int, int, int] | None = None  # (mantissa bits, bias, largest finite code)
    recent: bool = False  # whether it keeps a recent window in bfloat16 (above)
    codebook: bool = False  # 4-bit codes index kernels/attention/gauss4.py's Gaussian levels (rotated rows)

    @property
    def row_code(self) -> int:
        """How the attention kernel reads a uint8 cache's codes (kernels/attention/paged.py)."""
        return self.fp8[0] if self.fp8 else GAUSS4 if self.codebook else 0

    def row_elements(self, head_dim: int) -> int:
        return head_dim // self.values_per_element

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one (slot, kv head) row of keys (or values), its scale included."""
        return self.row_elements(head_dim) * np.dtype(self.storage).itemsize + 4 * self.has_scale

    def check_head_dim(self, head_dim: int) -> None:
        if self.rotated and not is_power_of_two(head_dim):
            raise ValueError(f'kv_dtype "{self.name}" rotates each head by a Hadamard transform of order '
                             f"head_dim, which needs a power of two (this model's head_dim is {head_dim}); "
                             f'use "{self.name.removesuffix("_hadamard")}"')
        if self.values_per_element == 2 and head_dim % 2:
            raise ValueError(f'kv_dtype "{self.name}" packs two values a byte: head_dim must be even '
                             f"(got {head_dim})")


KV_FORMATS = {f.name: f for f in (
    KVFormat("float32", np.float32, 1, False, False),
    KVFormat("bfloat16", np.uint16, 1, False, False),
    KVFormat("int8", np.int8, 1, True, False),
    KVFormat("int8_hadamard", np.int8, 1, True, True),
    KVFormat("fp8_e4m3", np.uint8, 1, True, False, E4M3, recent=True),
    KVFormat("fp8_e5m2", np.uint8, 1, True, False, E5M2, recent=True),
    KVFormat("int4", np.uint8, 2, True, False),
    KVFormat("int4_hadamard", np.uint8, 2, True, True, codebook=True),
)}


def write_kv_as(fmt: KVFormat, k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale,
                recent=NO_WINDOW) -> None:
    """k, v: [T, n_kv, D] f32 into one layer's cache, and as bfloat16 into the shadows of paged_attention's
    recent window; a rotated format rotates k and v in place first (copies, when they are strided views)."""
    k, v, slot_mapping = _one_layout(k), _one_layout(v), np.asarray(slot_mapping, np.int64)
    if fmt.rotated:
        hadamard_inplace(k)
        hadamard_inplace(v)
    if recent.group > 0:
        write_kv_shadows(k, v, slot_mapping, k_cache.shape[1], recent.shadow_of, recent.k_wide, recent.v_wide)
    if fmt.fp8 is not None:
        write_kv_scaled(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale, FP8, *fmt.fp8)
    elif fmt.values_per_element == 2:
        write_kv_scaled(k, v, slot_mapping, k_cache, v_cache, k_scale, v_scale,
                        GAUSS4 if fmt.codebook else INT4, 0, 0, 0)
    elif fmt.has_scale:
        write_kv_scaled(k, v, slot_mapping, _bytes(k_cache), _bytes(v_cache), k_scale, v_scale, INT8, 0, 0, 0)
    else:
        write_kv(k, v, slot_mapping, k_cache, v_cache)


def attend_as(fmt: KVFormat, q, k_cache, v_cache, k_scale, v_scale, block_tables, token_seq, positions,
              window, softmax_scale, out, tree_starts=None, tree_mask=None, softcap=0.0,
              recent=NO_WINDOW) -> None:
    """kernels/attention.paged_attention over one layer's cache in its format (and its recent window, recent);
    a rotated format rotates q in place (a copy, when it is a strided view) and rotates out back."""
    q = _one_layout(q)
    if fmt.rotated:
        hadamard_inplace(q)
    paged_attention(q, _bytes(k_cache), _bytes(v_cache), k_scale, v_scale, fmt.has_scale, block_tables,
                    token_seq, positions, window, softmax_scale, out, tree_starts, tree_mask, softcap,
                    fmt.row_code, recent)
    if fmt.rotated:
        hadamard_inplace(out)


def _bytes(cache: np.ndarray) -> np.ndarray:
    # an int8 cache as its bytes: the kernels read every one-byte form from one uint8 cache (row_code 0 and a
    # code a value: int8), so each compiles once for it, not again for int8
    return cache.view(np.uint8) if cache.dtype == np.int8 else cache


def _one_layout(x: np.ndarray) -> np.ndarray:
    # x, or a C-contiguous copy of a strided view (the model's q, k and v are column slices of the fused qkv
    # output): the kernels are compiled once per KV dtype, not again per layout (numba specializes on it),
    # and the copy is small beside the attention that reads it
    return np.ascontiguousarray(x)
