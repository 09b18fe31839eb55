"""An engine's ranks: the whole model in this process (tensor_parallel_size 1), or rank 0 here and a group of
follower processes (models/tensor_parallel/group.py), started before rank 0 loads so the shards load side by
side. What the engine sizes from the model (the KV pool, the context) is computed here from the spec alone,
once for every rank: each rank's pool has the same blocks, each holding its KV heads."""

import os
import threading
from pathlib import Path

from cluster_configs.engine_config import EngineConfig
from models.loader import read_spec
from models.tensor_parallel.collectives import WHOLE, Sharded, Whole
from models.tensor_parallel.group import RankGroup, core_shares, rank_shard
from scheduling.kv_cache_manager import num_kv_blocks, window_shadows


class TensorParallelStart:
    def __init__(self, model_path: str | Path, config: EngineConfig,
                 rank_cpu_ids: tuple[tuple[int, ...], ...] = ()):
        """rank_cpu_ids: ranks 1..'s cores; (): the allowed cores split evenly, rank 0 the first share."""
        size = config.tensor_parallel_size
        self.shard = rank_shard(0, config)
        spec = read_spec(model_path)
        local = self.shard.local_spec(spec)  # a shape ranks cannot split: refused before a process starts
        self.vocab_size = spec.vocab_size
        self.max_model_len = config.max_model_len or spec.max_position_embeddings
        self.num_blocks = num_kv_blocks(local, config, self.max_model_len)
        allowed = tuple(sorted(os.sched_getaffinity(0)))
        if rank_cpu_ids and len(rank_cpu_ids) != size - 1:
            raise ValueError(f"cores for {len(rank_cpu_ids)} follower ranks, tensor_parallel_size {size}")
        shares = [allowed, *rank_cpu_ids] if rank_cpu_ids or size == 1 else core_shares(list(allowed), size)
        self.cpu_ids = shares[0]  # rank 0's kernel threads run on its share of the cores
        self._pinned_thread: int | None = None
        self.sharded: Sharded | None = None  # rank 0's collectives, once the model has them
        self.group = None if size == 1 else RankGroup.start(
            model_path, config, shares, hidden=spec.hidden_size, vocab=spec.vocab_size,
            num_blocks=self.num_blocks, max_model_len=self.max_model_len, num_shadows=window_shadows(config))

    def pin_stepping_thread(self) -> None:
        """Rank 0's kernels run on the thread that steps the engine (one kernel thread a rank), which is
        pinned here to rank 0's cores, once per thread: left to float, it could share a follower's core and
        make every collective wait for the slowed follower. A deployment's worker process is pinned
        already."""
        if self.group is None or self._pinned_thread == threading.get_ident():
            return
        os.sched_setaffinity(0, self.cpu_ids)  # pid 0: the calling thread alone
        self._pinned_thread = threading.get_ident()

    def wait_ready(self) -> None:
        if self.group is not None:
            self.group.wait_ready()

    def collectives(self, num_threads: int) -> Whole:
        if self.group is None:
            return WHOLE
        self.sharded = self.group.collectives(self.shard, self.vocab_size, num_threads)
        return self.sharded

    def stats(self, weight_bytes: int, kv_cache_bytes: int) -> dict:
        """What each rank holds and its process, rank 0's (weight_bytes, kv_cache_bytes: this process's)
        first."""
        followers = [] if self.group is None else self.group.ready
        pids = [os.getpid()] + ([] if self.group is None else self.group.pids)
        sharded = self.sharded
        return {"size": self.shard.size, "pids": pids,
                # rank 0's seconds in the all-reduces and the logits' gather, and in sending the plans
                "collective_seconds": 0.0 if sharded is None else sharded.collective_seconds,
                # of those, waiting for a follower to reach the collective (it ran its part slower)
                "collective_wait_seconds": 0.0 if sharded is None else sharded.wait_seconds,
                "plan_seconds": 0.0 if sharded is None else sharded.plan_seconds,
                "weight_bytes": [weight_bytes] + [r.weight_bytes for r in followers],
                "kv_cache_bytes": [kv_cache_bytes] + [r.kv_cache_bytes for r in followers]}

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
