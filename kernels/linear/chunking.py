"""How many tokens of x one pass over a matrix's weights takes, for every linear kernel: the chunk of x whose
rows fill half of a core's L2 (so it stays there while every row group of the weights passes over it), a
whole number of register blocks, at least one. The L2 is this CPU's (linear_tiles: /sys), passed to every
kernel as x_chunk_bytes: a cached kernel compiled on one CPU keeps no other CPU's size."""

from dataclasses import dataclass
from functools import cache
from pathlib import Path

from numba import njit

from kernels.simd.cpu import CPU_ROOT, l2_cache

DEFAULT_L2_BYTES = 1 << 20  # where /sys does not say (Zen 4's, Sapphire Rapids' is 2 MiB, Skylake's 256 KiB)


@dataclass(frozen=True)
class LinearTiles:
    x_chunk_bytes: int  # of x per pass over the weights: half of a core's L2
    why: str  # for the decision log


@cache
def linear_tiles(root: Path = CPU_ROOT) -> LinearTiles:
    """The tiles of this CPU (of the first core this process may run on), read once per process: the cores
    of one machine share an L2 size. root: /sys's cpu directory."""
    found = l2_cache(root)
    if found is None:
        return LinearTiles(DEFAULT_L2_BYTES // 2,
                           f"half of {DEFAULT_L2_BYTES >> 10} KiB: /sys gives no L2 size")
    cpu_id, nbytes = found
    return LinearTiles(nbytes // 2, f"half of cpu {cpu_id}'s L2 ({nbytes >> 10} KiB, /sys)")


@njit(inline="always", nogil=True)
def token_chunk(row_bytes, block_tokens, x_chunk_bytes):
    # row_bytes: a token's bytes of x as the kernel reads them -> tokens per pass, a multiple of block_tokens
    return max(block_tokens, x_chunk_bytes // row_bytes // block_tokens * block_tokens)
