"""Tensor-parallel ranks for tests: each a spawned process (a fresh interpreter, as a real rank) that loads
its shard of each checkpoint and runs the same forward batches; rank 0 sends back the logits and every rank
its hidden states. Kept apart from the test modules so a rank imports neither torch nor transformers."""

import multiprocessing
from pathlib import Path

import numpy as np

from memory.kv_cache import KVCache
from memory.shared_group import GroupLayout, SharedGroup
from models.batch import ForwardBatch
from models.checkpoint import load_weights
from models.decoder import DecoderModel
from models.tensor_parallel.collectives import Sharded
from models.tensor_parallel.shard import TensorShard

SPAWN = multiprocessing.get_context("spawn")
BLOCK = 16
NUM_BLOCKS = 8


def two_sequence_batches(vocab: int, seed: int) -> list[ForwardBatch]:
    """A prefill of two prompts (35 and 40 tokens) in one flat batch, then a decode step of both, the logits
    and hidden states of chosen rows asked for (test_hf_parity's shape)."""
    rng = np.random.default_rng(seed)
    lens = (35, 40)
    tables = np.array([[0, 1, 2, 7], [3, 4, 5, 6]], np.int32)  # [S, max_blocks]
    token_seq = np.repeat([0, 1], lens).astype(np.int32)
    positions = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    slots = tables[token_seq, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    prefill = ForwardBatch(rng.integers(3, vocab, sum(lens)), positions, token_seq, slots, tables,
                           np.array([34, 74]), hidden_indices=np.array([0, 34, 35, 53, 74]))
    positions = np.array(lens, np.int32)
    token_seq = np.array([0, 1], np.int32)
    slots = tables[token_seq, positions // BLOCK].astype(np.int64) * BLOCK + positions % BLOCK
    decode = ForwardBatch(rng.integers(3, vocab, 2), positions, token_seq, slots, tables, np.array([0, 1]),
                          hidden_indices=np.array([0, 1]))
    return [prefill, decode]


def run_forward(model: DecoderModel, batches: list[ForwardBatch]) -> list[tuple]:
    s = model.spec
    kv = KVCache(s.num_layers, NUM_BLOCKS, BLOCK, s.num_kv_heads, s.head_dim, "float32")
    return [model.forward_hidden(b, kv) for b in batches]


Job = tuple[Path, list[ForwardBatch], bool]  # (checkpoint, batches, expert parallel)


def rank_main(layout: GroupLayout, rank: int, jobs: list[Job], results) -> None:
    """For each (checkpoint, batches, expert parallel): load this rank's shard, run the batches twice (a fresh
    KV cache each time); -> results.put((rank, [(outputs, rerun outputs, weight bytes, KV heads), ...])), or
    (rank, error)."""
    group = None
    try:
        group = SharedGroup.create(layout) if rank == 0 else SharedGroup.attach(layout, rank)
        if rank == 0:
            group.wait_attached()
        done = []
        for model_dir, batches, expert_parallel in jobs:
            shard = TensorShard(rank, layout.num_ranks, expert_parallel)
            spec, weights = load_weights(model_dir, "float32", shard)
            local = shard.local_spec(spec)
            model = DecoderModel(local, weights, collectives=Sharded(group, shard, spec.vocab_size))
            done.append((run_forward(model, batches), run_forward(model, batches), weights.nbytes,
                         local.num_kv_heads))
        results.put((rank, done))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        if group is not None:
            group.abort()
        results.put((rank, repr(exc)))
    finally:
        if group is not None:
            group.close()


def run_ranks(size: int, jobs: list[Job]) -> dict[int, list]:
    """Starts `size` ranks on the jobs; -> rank -> its results (raises if a rank failed)."""
    layout = GroupLayout.new(size, slot_elems=1 << 16, plan_bytes=64, timeout_s=120)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=rank_main, args=(layout, r, jobs, results)) for r in range(size)]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
    failed = {r: v for r, v in got.items() if isinstance(v, str)}
    if failed:
        raise AssertionError(f"ranks failed: {failed}")
    return got
