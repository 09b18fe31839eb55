"""Prefill attention in tiles (kernels/attention/tiles.py): equals a float64 softmax over the same dequantized
(and rotated back) cache contents for every KV dtype, and gives each row the per-token kernel's bits, over
scattered blocks, windows, GQA, sequences of lengths around the tile size in one call and chunks; a row's bits
do not depend on its batch, on where a chunked prefill splits its prompt, or on the thread count."""

import numba
import numpy as np
import pytest

from kernels.attention import paged as attention
from kernels.attention.tiles import row_tiles
from memory.kv_formats import KV_FORMATS, attend_as, write_kv_as
from tests.kernels.test_attention import reference
from tests.support.kv_reference import KV_DTYPES, empty_cache, head_dim_for, score_noise, stored

TILE = 4
LENGTHS = [1, TILE - 1, TILE, TILE + 1, 3 * TILE + 2, 29]  # one sequence each, every position a query row
H, N_KV, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 4, 40  # GQA: 3 query heads a kv head


class Prefill:
    """Every prompt of LENGTHS written to one layer's cache in scattered blocks, and queries for each row."""

    def __init__(self, kv_dtype: str, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.fmt, self.D = KV_FORMATS[kv_dtype], head_dim_for(kv_dtype)
        self.caches = empty_cache(kv_dtype, NUM_BLOCKS, BLOCK_SIZE, N_KV, self.D)
        free = list(rng.permutation(NUM_BLOCKS))
        self.tables = np.full((len(LENGTHS), 8), -1, np.int32)
        for s, n in enumerate(LENGTHS):
            num = (n + BLOCK_SIZE - 1) // BLOCK_SIZE
            self.tables[s, :num] = [free.pop() for _ in range(num)]
        self.token_seq = np.concatenate([np.full(n, s, np.int32) for s, n in enumerate(LENGTHS)])
        self.positions = np.concatenate([np.arange(n, dtype=np.int32) for n in LENGTHS])
        self.slots = self.tables[self.token_seq, self.positions // BLOCK_SIZE] * BLOCK_SIZE \
            + self.positions % BLOCK_SIZE
        T = len(self.positions)
        self.q = rng.standard_normal((T, H, self.D)).astype(np.float32)
        k = rng.standard_normal((T, N_KV, self.D)).astype(np.float32)
        v = rng.standard_normal((T, N_KV, self.D)).astype(np.float32)
        write_kv_as(self.fmt, k, v, self.slots, *self.caches)

    def attend(self, rows, window: int) -> np.ndarray:
        out = np.empty((len(rows), H, self.D), np.float32)
        attend_as(self.fmt, self.q[rows], *self.caches, self.tables, self.token_seq[rows],
                  self.positions[rows], window, 0.2, out)
        return out

    def reference(self, window: int) -> np.ndarray:
        k_cache, v_cache, k_scale, v_scale = self.caches
        k_all = stored(self.fmt.name, k_cache, k_scale, self.D)
        v_all = stored(self.fmt.name, v_cache, v_scale, self.D)
        seq_slots = [self.tables[s, np.arange(n) // BLOCK_SIZE] * BLOCK_SIZE + np.arange(n) % BLOCK_SIZE
                     for s, n in enumerate(LENGTHS)]
        keys = [k_all[seq_slots[s]] for s in self.token_seq]
        values = [v_all[seq_slots[s]] for s in self.token_seq]
        noise = score_noise(self.fmt.name, k_scale, self.D)
        noises = [noise[seq_slots[s]] for s in self.token_seq]
        return reference(self.q.astype(np.float64), keys, values, self.positions, window, 0.2, noises)


def kernel(monkeypatch, tiles: bool, chunk: int) -> None:
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 0)
    monkeypatch.setattr(attention, "TASKS_PER_THREAD", 0)  # never the flash-decoding split
    monkeypatch.setattr(attention, "TILE_ROWS", TILE if tiles else 1)  # tiles of one row: per-token kernel
    monkeypatch.setattr(attention, "CHUNK", chunk)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("chunk", [5, 256])
def test_tiles_give_the_per_token_bits_and_the_float64_softmax(kv_dtype, window, chunk, monkeypatch):
    prefill = Prefill(kv_dtype)
    rows = np.arange(len(prefill.positions))
    kernel(monkeypatch, tiles=False, chunk=chunk)
    per_token = prefill.attend(rows, window)
    kernel(monkeypatch, tiles=True, chunk=chunk)
    tiled = prefill.attend(rows, window)
    np.testing.assert_array_equal(tiled, per_token)
    ref = prefill.reference(window)
    assert np.abs(tiled - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6


@pytest.mark.parametrize("window", [0, 6])
def test_a_rows_bits_do_not_depend_on_its_batch_the_prompts_split_or_the_threads(window, monkeypatch):
    prefill = Prefill("int4_hadamard", seed=3)
    kernel(monkeypatch, tiles=True, chunk=5)
    rows = np.arange(len(prefill.positions))
    together = prefill.attend(rows, window)
    last = np.flatnonzero(prefill.token_seq == len(LENGTHS) - 1)  # the 29-token prompt
    for part in (last, last[:11], last[11:], last[7:8], rows[::-1]):  # alone, chunked prefill, a decode row
        np.testing.assert_array_equal(prefill.attend(part, window), together[part])
    threads = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        np.testing.assert_array_equal(prefill.attend(rows, window), together)
    finally:
        numba.set_num_threads(threads)


def test_tiles_are_runs_of_consecutive_positions_of_one_sequence_outside_trees():
    token_seq = np.array([0, 0, 0, 0, 0, 1, 1, 2, 2, 2, 2], np.int32)
    positions = np.array([0, 1, 2, 3, 4, 7, 8, 3, 5, 6, 7], np.int32)
    tree_starts = np.array([-1] * 9 + [5, 5], np.int32)
    np.testing.assert_array_equal(row_tiles(token_seq, positions, tree_starts, 3, 0),
                                  [0, 3, 5, 7, 8, 9, 10, 11])
    # a recent window's groups of 4 positions: positions 4 and 8 start tiles too
    np.testing.assert_array_equal(row_tiles(token_seq, positions, tree_starts, 3, 4),
                                  [0, 3, 4, 5, 6, 7, 8, 9, 10, 11])
