"""Tree attention (kernels/attention/paged.py with a tree mask) against a float64 softmax over the slots each
node may see, over scattered blocks with random trees; a chain as a mask gives the bits of plain positions."""

import numpy as np
import pytest

from kernels.attention import paged as attention
from memory.kv_formats import KV_FORMATS, attend_as, write_kv_as
from tests.support.kv_reference import KV_DTYPES, empty_cache, head_dim_for, score_noise, stored

H, N_KV, BLOCK, NUM_BLOCKS = 6, 2, 4, 64


def random_tree(rng, num_nodes: int) -> np.ndarray:
    """parents [n]: node i's parent (< i), -1 for the root."""
    return np.array([-1] + [int(rng.integers(0, i)) for i in range(1, num_nodes)], np.int64)


def depths_and_ancestors(parents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = len(parents)
    depth, mask = np.zeros(n, np.int64), np.zeros((n, n), bool)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j] = True
            j = parents[j]
        depth[i] = mask[i].sum() - 1
    return depth, mask


class Batch:
    """Sequences of a verification step on scattered blocks: each a context and either a token tree (every
    node a query) or one plain decode token; the KV of every slot written (tree nodes at start + i)."""

    def __init__(self, rng, kv_dtype: str, trees: list[np.ndarray | None], contexts: list[int], window: int):
        free = list(rng.permutation(NUM_BLOCKS))
        self.tables = np.full((len(trees), 16), -1, np.int32)
        seq_len = [c + (len(p) if p is not None else 1) for c, p in zip(contexts, trees)]
        for s, n in enumerate(seq_len):
            for b in range(-(-n // BLOCK)):
                self.tables[s, b] = free.pop()
        self.kv_dtype, self.fmt, self.D = kv_dtype, KV_FORMATS[kv_dtype], head_dim_for(kv_dtype)
        D = self.D
        caches = empty_cache(kv_dtype, NUM_BLOCKS, BLOCK, N_KV, D)
        self.k_cache, self.v_cache, self.k_scale, self.v_scale = caches
        slots = np.array([self.slot(s, j) for s, n in enumerate(seq_len) for j in range(n)], np.int32)
        k, v = (rng.standard_normal((len(slots), N_KV, D)).astype(np.float32) for _ in range(2))
        write_kv_as(self.fmt, k, v, slots, self.k_cache, self.v_cache, self.k_scale, self.v_scale)
        # queries: every tree node, or the decode token
        width = max((len(p) for p in trees if p is not None), default=0)
        token_seq, positions, starts, masks, self.visible = [], [], [], [], []
        for s, (ctx, parents) in enumerate(zip(contexts, trees)):
            if parents is None:
                token_seq.append(s)
                positions.append(ctx)
                starts.append(-1)
                masks.append(np.zeros(width, bool))
                self.visible.append([j for j in range(ctx + 1) if not window or j > ctx - window])
                continue
            depth, ancestors = depths_and_ancestors(parents)
            for i in range(len(parents)):
                # the caller's part
                in_window = ancestors[i] & ((depth > depth[i] - window) if window else True)
                token_seq.append(s)
                positions.append(ctx + depth[i])
                starts.append(ctx)
                masks.append(np.pad(in_window, (0, width - len(parents))))
                self.visible.append([j for j in range(ctx) if not window or j > ctx + depth[i] - window]
                                    + [ctx + j for j in np.flatnonzero(in_window)])
        self.token_seq, self.positions, self.starts = (np.array(a, np.int32)
                                                       for a in (token_seq, positions, starts))
        self.mask = np.array(masks, np.uint8).reshape(len(token_seq), width)
        self.q = rng.standard_normal((len(token_seq), H, D)).astype(np.float32)
        self.window = window

    def slot(self, s: int, j: int) -> int:
        return self.tables[s, j // BLOCK] * BLOCK + j % BLOCK

    def run(self, tree: bool = True) -> np.ndarray:
        out = np.empty_like(self.q)
        extra = (self.starts, self.mask) if tree else ()
        attend_as(self.fmt, self.q.copy(), self.k_cache, self.v_cache, self.k_scale, self.v_scale,
                  self.tables, self.token_seq, self.positions, self.window, 0.2, out, *extra)
        return out

    def reference(self) -> np.ndarray:
        keys = stored(self.kv_dtype, self.k_cache, self.k_scale, self.D)
        values = stored(self.kv_dtype, self.v_cache, self.v_scale, self.D)
        noise = score_noise(self.kv_dtype, self.k_scale, self.D)
        out = np.empty(self.q.shape)
        group = H // N_KV
        for t, seen in enumerate(self.visible):
            slots = [self.slot(self.token_seq[t], j) for j in seen]
            for h in range(H):
                qh = self.q[t, h].astype(np.float64)
                s = keys[slots, h // group] @ qh * 0.2 - 0.5 * 0.2 ** 2 * (qh @ qh) * noise[slots, h // group]
                p = np.exp(s - s.max())
                out[t, h] = p @ values[slots, h // group] / p.sum()
        return out


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 6])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_attention_matches_float64_over_each_nodes_visible_slots(kv_dtype, window, parallel, seed,
                                                                      monkeypatch):
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 0 if parallel else 1 << 62)
    rng = np.random.default_rng(seed)
    trees = [random_tree(rng, 9), None, random_tree(rng, 14), random_tree(rng, 1), None]
    batch = Batch(rng, kv_dtype, trees, contexts=[11, 7, 0, 23, 18], window=window)
    out, ref = batch.run(), batch.reference()
    assert np.abs(out - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6


def test_a_node_sees_its_ancestors_and_not_its_siblings():
    """Changing a node's KV moves exactly the outputs of that node and its descendants."""
    rng = np.random.default_rng(7)
    parents = np.array([-1, 0, 0, 1, 2, 3])  # two branches: 0-1-3-5 and 0-2-4
    batch = Batch(rng, "float32", [parents], contexts=[5], window=0)
    for node, descendants in ((4, [4]), (1, [1, 3, 5]), (0, [0, 1, 2, 3, 4, 5])):
        before = batch.run()
        b = batch.tables[0, (5 + node) // BLOCK]
        batch.k_cache[b, (5 + node) % BLOCK] += 1.0
        moved = [i for i in range(len(parents)) if not np.array_equal(batch.run()[i], before[i])]
        assert moved == descendants


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_chain_as_a_tree_gives_the_bits_of_plain_positions(kv_dtype):
    rng = np.random.default_rng(3)
    chain = np.arange(-1, 6)  # node i's parent is i - 1
    batch = Batch(rng, kv_dtype, [chain, None, chain], contexts=[9, 4, 0], window=0)
    plain = batch.run(tree=False)  # positions alone: node i at slot ctx + i sees slots 0 .. ctx + i
    assert np.array_equal(batch.run(), plain)
