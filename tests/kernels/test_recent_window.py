"""The fp8 forms' recent window (kernels/attention/chunks.py): paged attention against a float64 softmax whose
keys and values are bfloat16 (as written) from max(recent_start(position), wide_from[seq]) on and the stored
codes before, on every kernel path; a token's bits independent of its tile, batch and chunk split; a chain of
drafts as a tree gives the bits of plain positions. Then the engine: the shadows it keeps are exactly those
the rule reads, and chunked prefill and preemption change no fp8 token."""

import numpy as np
import pytest

import numaserve as ns
from kernels.attention import paged as attention
from kernels.attention.chunks import RecentWindow, recent_start
from kernels.formats.bf16 import from_bf16
from memory.kv_cache import kv_bytes_per_token
from memory.kv_formats import KV_FORMATS, RECENT_GROUP, attend_as, write_kv_as
from models.tokenizer import Tokenizer
from numaserve.demo import DEMO_DIR
from numaserve.demo_eval import GREEDY, greedy_prompts
from tests.support.kv_reference import empty_cache, head_dim_for, stored

H, N_KV, BLOCK, NUM_BLOCKS, GROUP = 6, 2, 4, 40, 4  # groups of 4 positions: windows of 4 to 7 slots
LENGTHS = [1, 13, 37]  # three sequences on scattered blocks
WIDE_FROM = [0, 6, 0]  # the second one as after a prefix hit at slot 6: its slots before it have no shadow


class Layer:
    """One layer's cache with every slot of LENGTHS written, a shadow on each block from its sequence's
    WIDE_FROM on, and a query for every position (the chunked-prefill shape)."""

    def __init__(self, kv_dtype: str):
        rng = np.random.default_rng(1)
        self.kv_dtype, self.fmt, self.D = kv_dtype, KV_FORMATS[kv_dtype], head_dim_for(kv_dtype)
        self.caches = empty_cache(kv_dtype, NUM_BLOCKS, BLOCK, N_KV, self.D)
        free = list(rng.permutation(NUM_BLOCKS))
        self.tables = np.full((len(LENGTHS), 16), -1, np.int32)
        shadow_of = np.full(NUM_BLOCKS, -1, np.int32)
        num_shadows = 0
        token_seq, positions = [], []
        for s, n in enumerate(LENGTHS):
            for b in range(-(-n // BLOCK)):
                self.tables[s, b] = free.pop()
                if (b + 1) * BLOCK > WIDE_FROM[s]:
                    shadow_of[self.tables[s, b]] = num_shadows
                    num_shadows += 1
            token_seq += [s] * n
            positions += range(n)
        self.token_seq, self.positions = np.array(token_seq, np.int32), np.array(positions, np.int32)
        self.slots = np.array([self.slot(s, p) for s, p in zip(token_seq, positions)], np.int64)
        T = len(positions)
        self.q = rng.standard_normal((T, H, self.D)).astype(np.float32)
        self.k = rng.standard_normal((T, N_KV, self.D)).astype(np.float32)
        self.v = rng.standard_normal((T, N_KV, self.D)).astype(np.float32)
        wide_shape = (num_shadows, BLOCK, N_KV, self.D)
        self.wide = RecentWindow(np.zeros(wide_shape, np.uint16), np.zeros(wide_shape, np.uint16), shadow_of,
                                 np.array(WIDE_FROM, np.int32), GROUP)
        write_kv_as(self.fmt, self.k.copy(), self.v.copy(), self.slots, *self.caches, self.wide)

    def slot(self, s: int, j: int) -> int:
        return int(self.tables[s, j // BLOCK]) * BLOCK + j % BLOCK

    def run(self, rows, tree_starts=None, tree_mask=None, positions=None) -> np.ndarray:
        out = np.empty((len(rows), H, self.D), np.float32)
        positions = self.positions[rows] if positions is None else positions
        attend_as(self.fmt, self.q[rows].copy(), *self.caches, self.tables, self.token_seq[rows], positions,
                  0, 0.2, out, tree_starts, tree_mask, 0.0, self.wide)
        return out

    def reference(self, rows) -> np.ndarray:
        k_cache, v_cache, k_scale, v_scale = self.caches
        narrow = (stored(self.kv_dtype, k_cache, k_scale, self.D),
                  stored(self.kv_dtype, v_cache, v_scale, self.D))
        wide = [from_bf16(a).astype(np.float64).reshape(-1, N_KV, self.D) for a in self.wide[:2]]
        shadow_of = self.wide[2]
        out = np.empty((len(rows), H, self.D))
        for i, t in enumerate(rows):
            s, p = self.token_seq[t], self.positions[t]
            first_wide = max(recent_start(p, GROUP), WIDE_FROM[s])
            keys, values = [], []
            for j in range(p + 1):
                slot = self.slot(s, j)
                if j >= first_wide:  # the shadow of the slot's block
                    row = shadow_of[slot // BLOCK] * BLOCK + slot % BLOCK
                    keys.append(wide[0][row]), values.append(wide[1][row])
                else:
                    keys.append(narrow[0][slot]), values.append(narrow[1][slot])
            keys, values = np.array(keys), np.array(values)
            for h in range(H):
                scores = keys[:, h // (H // N_KV)] @ self.q[t, h].astype(np.float64) * 0.2
                e = np.exp(scores - scores.max())
                out[i, h] = e @ values[:, h // (H // N_KV)] / e.sum()
        return out


@pytest.fixture(params=["fp8_e4m3", "fp8_e5m2"])
def layer(request):
    return Layer(request.param)


def test_the_shadows_hold_what_was_written_in_bfloat16(layer):
    shadow_of = layer.wide[2]
    for t, slot in enumerate(layer.slots):
        shadow = shadow_of[slot // BLOCK]
        if shadow >= 0:
            for wide, written in ((layer.wide[0], layer.k[t]), (layer.wide[1], layer.v[t])):
                np.testing.assert_allclose(from_bf16(wide[shadow, slot % BLOCK]), written, rtol=2 ** -8)


@pytest.mark.parametrize("path", ["serial", "parallel", "split"])
def test_attention_with_a_recent_window_matches_float64_softmax(layer, path, monkeypatch):
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 1 << 62 if path == "serial" else 0)
    rows = np.arange(len(layer.positions))
    if path == "split":  # flash-decoding: one token, its slots in chunks of 8 as tasks of their own
        monkeypatch.setattr(attention, "CHUNK", 8)
        monkeypatch.setattr(attention, "get_num_threads", lambda: 4)
        rows = rows[-1:]
    ref = layer.reference(rows)
    assert np.abs(layer.run(rows) - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6


def test_the_window_is_read_where_the_rule_says(layer):
    # the same layer with no window reads codes alone: the two differ on every token that reads a wide slot
    rows = np.arange(len(layer.positions))
    windowed = layer.run(rows)
    layer.wide = layer.wide._replace(group=0)
    plain = layer.run(rows)
    differs = np.abs(windowed - plain).max(axis=(1, 2)) > 1e-4
    # a token reads its own slot wide unless it is before its sequence's wide_from
    np.testing.assert_array_equal(differs, layer.positions >= np.array(WIDE_FROM)[layer.token_seq])


def test_a_tokens_bits_do_not_depend_on_its_tile_batch_or_chunks(layer, monkeypatch):
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 0)
    rows = np.arange(len(layer.positions))
    together = layer.run(rows)  # tiles of consecutive rows (breaking at each group's first position)
    for t in rows:
        np.testing.assert_array_equal(layer.run(rows[t:t + 1]), together[t:t + 1])
    monkeypatch.setattr(attention, "CHUNK", 8)  # 37 slots in chunks of 8: one task, or a task each (split)
    monkeypatch.setattr(attention, "get_num_threads", lambda: 1)
    one_task = layer.run(rows[-1:])
    monkeypatch.setattr(attention, "get_num_threads", lambda: 4)
    np.testing.assert_array_equal(layer.run(rows[-1:]), one_task)


def test_a_chain_of_drafts_as_a_tree_gives_the_bits_of_plain_positions(layer):
    # the last 5 tokens of the longest sequence as a chain after its first 32 slots
    rows = np.arange(len(layer.positions))[-5:]
    start = int(layer.positions[rows[0]])
    mask = np.tril(np.ones((5, 5), np.uint8))
    tree = layer.run(rows, np.full(5, start, np.int32), mask)
    np.testing.assert_array_equal(tree, layer.run(rows))


# the engine, on the shipped demo model

BASE = DEMO_DIR / "base"


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return greedy_prompts(Tokenizer.from_dir(BASE))[:6]


def check_shadows(engine) -> None:
    """Every running request's blocks its next step reads wide carry a shadow, and no other block does."""
    kv, bs = engine.kv_cache, engine.kv_cache.block_size
    wanted = set()
    for req in engine.scheduler.running:
        first = max(req.wide_from, recent_start(req.num_computed_tokens, RECENT_GROUP))
        wanted |= {req.block_ids[i] for i in range(first // bs, -(-req.num_computed_tokens // bs))}
    assert set(np.flatnonzero(kv.shadow_of >= 0)) == wanted
    assert len(kv.free_shadows) + len(wanted) == kv.k_wide[0].shape[0]


def generate(llm, prompts) -> list[list[int]]:
    reqs = [llm.engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    while llm.engine.has_unfinished():
        llm.engine.step()
        check_shadows(llm.engine)
    return [r.output_token_ids for r in reqs]


def test_chunked_prefill_and_preemption_change_no_fp8_tokens_and_every_shadow_goes_back(prompts):
    kv_dtype = "fp8_e4m3"
    alone = generate(ns.LLM(BASE, kv_dtype=kv_dtype, enable_prefix_caching=False), prompts)
    chunked = ns.LLM(BASE, kv_dtype=kv_dtype, enable_prefix_caching=False, max_num_batched_tokens=40)
    assert generate(chunked, prompts) == alone  # prefill chunks of 40 cut through groups of 16
    small = ns.LLM(BASE, kv_dtype=kv_dtype, enable_prefix_caching=False, block_size=16, max_num_seqs=6,
                   kv_cache_bytes=24 * 16 * kv_bytes_per_token(6, 4, 32, kv_dtype))
    assert generate(small, prompts) == alone
    assert small.stats()["num_preemptions"] > 0
    assert (small.engine.kv_cache.shadow_of < 0).all()
