"""Session sequences whose KV stays in the pool between turns.

A turn is a Request over the sequence's history + its new input. While the sequence holds its blocks
(pinned: it holds a reference on each) the request starts from them when it is admitted (until then they
stay evictable, so a queued turn never holds blocks others wait for), and a turn prefills only its new input
and the previous turn's last token (whose KV was never computed). When the turn finishes its blocks pass to
the sequence instead of back to the pool. Idle sequences pin at most max_pinned_blocks (from
EngineConfig.session_kv_bytes); past it, and when the pool is short of blocks for a step, the least
recently used idle sequence is evicted: its blocks go back to the pool, its full ones stay findable in the
prefix cache, and its next turn recomputes what the cache no longer holds (counted: num_evictions).

fork() shares the full blocks (a reference each: full blocks are never written again, so sharing needs no
copy) and leaves out the partial last one, whose < block_size tokens the fork recomputes on its next turn.
Everything here runs on the engine's thread.
"""

from collections import OrderedDict

from memory.block_pool import NULL_BLOCK, BlockPool
from scheduling.request import Request


class SequenceKV:
    """One sequence's history and, between turns, the KV blocks that hold it."""

    def __init__(self, token_ids: list[int] | None = None):
        self.token_ids: list[int] = token_ids or []  # every turn's input and output so far
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_computed_tokens = 0  # of token_ids, those whose KV the blocks hold


class SequenceStore:
    def __init__(self, pool: BlockPool, block_size: int, max_pinned_blocks: int):
        self.pool = pool
        self.block_size = block_size
        self.max_pinned_blocks = max_pinned_blocks
        self.idle: OrderedDict[SequenceKV, None] = OrderedDict()  # holding blocks, least recently used first
        self.num_evictions = 0

    @property
    def num_pinned_blocks(self) -> int:
        return len({b for seq in self.idle for b in seq.block_ids if b != NULL_BLOCK})

    def stats(self) -> dict:
        return {"num_pinned_blocks": self.num_pinned_blocks, "num_session_evictions": self.num_evictions}

    def resume(self, req: Request) -> None:
        """On admission: a turn of req.sequence starts from the blocks the sequence holds (if it still does).
        Until then they stay evictable."""
        seq = req.sequence
        if seq is not None and seq in self.idle:
            del self.idle[seq]
            req.block_ids, req.block_hashes = seq.block_ids, seq.block_hashes
            req.num_computed_tokens = seq.num_computed_tokens
            seq.block_ids, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def suspend(self, req: Request) -> None:
        """A resumed turn that found no room: its blocks go back to its sequence (idle) until admitted."""
        if req.sequence is not None and req.block_ids:
            self._park(req)

    def hold(self, req: Request) -> None:
        """A finished turn: its tokens become the history, its blocks pass to the sequence."""
        req.sequence.token_ids = list(req.token_ids)
        self._park(req)
        while self.num_pinned_blocks > self.max_pinned_blocks:
            self.evict(next(iter(self.idle)))

    def _park(self, req: Request) -> None:
        seq = req.sequence
        seq.block_ids, seq.block_hashes = req.block_ids, req.block_hashes
        seq.num_computed_tokens = req.num_computed_tokens
        req.block_ids, req.block_hashes, req.num_computed_tokens = [], [], 0
        self.idle[seq] = None

    def reclaim(self, enough) -> bool:
        """Evict idle sequences, least recently used first, until enough(); -> enough()."""
        while not enough() and self.idle:
            self.evict(next(iter(self.idle)))
        return enough()

    def evict(self, seq: SequenceKV) -> None:
        self.drop(seq)
        self.num_evictions += 1

    def drop(self, seq: SequenceKV) -> None:
        """seq's blocks back to the pool (tail first); its history stays."""
        self.idle.pop(seq, None)
        self.pool.free(reversed(seq.block_ids))
        seq.block_ids, seq.block_hashes, seq.num_computed_tokens = [], [], 0

    def reset(self, seq: SequenceKV) -> None:
        self.drop(seq)
        seq.token_ids = []

    def fork(self, seq: SequenceKV) -> SequenceKV:
        """A new sequence with seq's history, sharing its full blocks."""
        fork = SequenceKV(list(seq.token_ids))
        num_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_hashes))
        shared = seq.block_ids[:num_full]
        if NULL_BLOCK not in shared and shared:  # (a sliding window's released blocks: recompute instead)
            self.pool.touch(shared)
            fork.block_ids, fork.block_hashes = list(shared), seq.block_hashes[:num_full]
            fork.num_computed_tokens = num_full * self.block_size
            self.idle[fork] = None
        return fork
