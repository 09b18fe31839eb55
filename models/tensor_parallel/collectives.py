"""What a forward over a shard needs from the other ranks: the embedding of the tokens in its vocabulary rows,
the sums of its partial outputs (after attention's o and the MLP's down), and the logits gathered on rank 0.
`WHOLE` is the model on one rank: each is the identity there, so the forward has no branch for parallelism."""

import time
from dataclasses import replace

import numpy as np

from cluster_configs.errors import RankLost
from memory.matrices import WeightMatrix
from memory.shared_group import SharedGroup
from models.linear import embed
from models.tensor_parallel.orders import ForwardOrder, LoraOrder, MergedOrder
from models.tensor_parallel.shard import TensorShard
from models.tensor_parallel.wire import encode


class Whole:
    """The whole model in one process."""

    rank = 0
    size = 1

    def begin(self, batch, embeddings: np.ndarray | None) -> None:
        pass

    def embed(self, w: WeightMatrix, token_ids: np.ndarray) -> np.ndarray:
        return embed(w, token_ids)

    def partial(self, rows: int, cols: int) -> np.ndarray | None:
        return None  # a partial result to reduce: wherever the kernel puts it

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        return x

    def gather_logits(self, logits: np.ndarray) -> np.ndarray | None:
        return logits


WHOLE = Whole()


class Sharded:
    """One rank's shard of the model, its partial results summed through the group's shared segment."""

    def __init__(self, group: SharedGroup, shard: TensorShard, vocab_size: int, num_threads: int = 1,
                 leader: bool = False, adapter_pipes: tuple = ()):
        """leader: rank 0 of a running group, which sends each forward's batch to the followers first, and
        the adapters it loaded into slots through adapter_pipes (a sending Connection a follower)."""
        self.group, self.shard, self.leader = group, shard, leader
        self.adapter_pipes = adapter_pipes
        self.rank, self.size = shard.rank, shard.size
        self.vocab_size = vocab_size
        self.vocab_lo, self.vocab_hi = shard.span(vocab_size)
        self.num_threads = num_threads
        # seconds in the all-reduces and the gather (waiting for the slowest rank included), and in sending
        # the plans, since the group started
        self.collective_seconds = self.plan_seconds = 0.0
        self._part: np.ndarray | None = None  # partial()'s slot, until its all_reduce

    def begin(self, batch, embeddings: np.ndarray | None) -> None:
        """A forward starts: rank 0 sends it to the followers, which run the same (models/tensor_parallel/
        group.py)."""
        if not self.leader:
            return
        start = time.perf_counter()
        lora, merged, adapters = None, None, []
        if batch.lora is not None:
            rows = batch.lora
            loads = rows.holder.take_loads()
            lora = LoraOrder(rows.starts, rows.ends, rows.slots, tuple(slot for slot, _ in loads))
            adapters += [adapter for _, adapter in loads]
            batch = replace(batch, lora=None)
        if batch.merged is not None:  # the copies' names: each follower merges its own
            m = batch.merged
            merged = MergedOrder(tuple((a, b, w.name) for a, b, w in m.runs), tuple(x.name for x in m.built),
                                 m.held)
            adapters += m.built
            batch = replace(batch, merged=None)
        order = ForwardOrder(batch, embeddings, lora, merged)
        self.group.send_plan(encode(order))
        for adapter in adapters:  # after the plan: each follower reads its pipe once it has the plan
            for rank, pipe in enumerate(self.adapter_pipes, start=1):
                try:
                    pipe.send_bytes(encode(adapter))
                except OSError:  # BrokenPipeError: the follower is gone
                    self.group.abort()
                    raise RankLost(f"rank 0: rank {rank} is gone (its adapter pipe broke); restart the "
                                   "group") from None
        self.plan_seconds += time.perf_counter() - start

    def embed(self, w: WeightMatrix, token_ids: np.ndarray) -> np.ndarray:
        """token_ids [T] -> [T, hidden]: the rows of this rank's vocabulary, zeros elsewhere, summed over the
        ranks (each token's row comes from exactly one rank, so the sum is that row's bits)."""
        mine = (token_ids >= self.vocab_lo) & (token_ids < self.vocab_hi)
        h = np.zeros((token_ids.shape[0], w.shape[1]), np.float32)
        if mine.any():
            h[mine] = embed(w, token_ids[mine] - self.vocab_lo)
        self.all_reduce(h)
        return h

    @property
    def wait_seconds(self) -> float:
        """Of collective_seconds, those spent waiting for another rank to reach the collective."""
        return self.group.wait_seconds

    def partial(self, rows: int, cols: int) -> np.ndarray:
        """[rows, cols] float32 in this rank's slot of the next all-reduce: a partial result written here is
        published without a copy. Take it right before the all_reduce it feeds."""
        self._part = self.group.next_part(rows, cols)
        return self._part

    def all_reduce(self, x: np.ndarray) -> np.ndarray:
        """-> the sum of every rank's x: x itself, summed in place, or a new array where x is partial()'s
        slot (the other ranks read it)."""
        start = time.perf_counter()
        if x is self._part:
            out = np.empty_like(x)
            self.group.all_reduce(x, self.num_threads, out)
        else:
            out = x
            self.group.all_reduce(x, self.num_threads)
        self._part = None
        self.collective_seconds += time.perf_counter() - start
        return out

    def gather_logits(self, logits: np.ndarray) -> np.ndarray | None:
        """logits [R, its vocabulary rows] -> [R, vocab] on rank 0, None on the others."""
        start = time.perf_counter()
        out = np.empty((logits.shape[0], self.vocab_size), np.float32) if self.rank == 0 else None
        self.group.gather(logits, out)
        self.collective_seconds += time.perf_counter() - start
        return out
