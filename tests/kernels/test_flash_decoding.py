"""Chunked attention (kernels/attention/paged.py): a token's chunks run in its own task or spread over tasks
(flash-decoding) give the same bits, equal the one-chunk kernel within float32 rounding and a float64
reference, for every KV dtype over scattered blocks, windows and trees, at forced chunk sizes."""

import numpy as np
import pytest

from kernels.attention import paged as attention
from tests.kernels.test_tree_attention import Batch, random_tree
from tests.support.kv_reference import KV_DTYPES

ONE_CHUNK = 1 << 30


def run(batch: Batch, monkeypatch, chunk: int, how: str) -> np.ndarray:
    monkeypatch.setattr(attention, "CHUNK", chunk)
    monkeypatch.setattr(attention, "PARALLEL_MIN_WORK", 1 << 62 if how == "serial" else 0)
    monkeypatch.setattr(attention, "TASKS_PER_THREAD", 1 << 30 if how == "split" else 0)
    return batch.run()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 9])
@pytest.mark.parametrize("chunk", [1, 4, 7])
def test_chunks_in_one_task_or_spread_give_the_same_bits_and_the_unsplit_softmax(kv_dtype, window, chunk,
                                                                                 monkeypatch):
    rng = np.random.default_rng(chunk)
    trees = [random_tree(rng, 9), None, random_tree(rng, 14), None, random_tree(rng, 1)]
    batch = Batch(rng, kv_dtype, trees, contexts=[11, 40, 0, 29, 23], window=window)
    split = run(batch, monkeypatch, chunk, "split")
    np.testing.assert_array_equal(run(batch, monkeypatch, chunk, "parallel"), split)
    np.testing.assert_array_equal(run(batch, monkeypatch, chunk, "serial"), split)
    whole = run(batch, monkeypatch, ONE_CHUNK, "parallel")
    scale = np.abs(whole).max()
    assert np.abs(split - whole).max() <= 2e-6 * scale
    assert not np.array_equal(split, whole)  # the chunks did change the order of the sums
    ref = batch.reference()
    assert np.abs(split - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6


def test_a_decode_tokens_bits_do_not_depend_on_its_batch_or_the_split(monkeypatch):
    rng = np.random.default_rng(5)
    batch = Batch(rng, "bfloat16", [None] * 4, contexts=[57, 3, 49, 30], window=0)
    together = run(batch, monkeypatch, 8, "parallel")  # four tokens: too many tasks to split
    for s in range(4):
        batch_s = Batch(np.random.default_rng(5), "bfloat16", [None] * 4, contexts=[57, 3, 49, 30], window=0)
        keep = batch_s.token_seq == s
        batch_s.q, batch_s.token_seq, batch_s.positions = batch.q[keep], batch_s.token_seq[keep], \
            batch_s.positions[keep]
        batch_s.starts, batch_s.mask = batch_s.starts[keep], batch_s.mask[keep]
        np.testing.assert_array_equal(run(batch_s, monkeypatch, 8, "split"), together[keep])


@pytest.mark.parametrize("num_rows, context, threads, split", [
    (1, 1024, 8, True), (1, 4096, 2, False), (1, 4096, 4, True), (8, 1024, 8, False), (1, 200, 8, False),
    (2, 1024, 8, True), (4, 4096, 8, False), (1024, 1024, 8, False)])
def test_long_contexts_split_when_the_kv_heads_leave_threads_idle(num_rows, context, threads, split):
    assert attention.split_chunks(num_rows, 4, context, threads, 256) is split
