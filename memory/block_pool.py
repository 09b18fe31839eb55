"""The block pool: integer block ids, ref counts, an LRU free queue, and a prefix-hash map.

Plain Python over ids; it never touches the KV arrays. A block with ref count 0 sits in the free
queue; if it still holds a committed prefix it stays findable by its hash until it is handed out
again (LRU: blocks freed longest ago are reused first).
"""

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

NULL_BLOCK = -1  # a block-table entry whose block was released (out of a sliding window)


def prefix_cache_key(adapter_id: str | None, cache_salt: str | None) -> tuple:
    """What besides its tokens decides whether two requests may share a cached block (hash_block's extra)."""
    return adapter_id, cache_salt


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: tuple) -> int:
    """Stable 64-bit hash of a full block, chained on its parent (same value in every process)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(struct.pack("<q", -1 if parent_hash is None else parent_hash))
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    h.update(repr(extra).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_key: list[tuple | None] = [None] * num_blocks  # (parent, tokens, extra) of a cached block
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block id

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self.free_queue)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref count 1), evicting least-recently freed cached prefixes; None if short."""
        if not self.can_allocate(n):
            return None
        block_ids = []
        for _ in range(n):
            block_id, _ = self.free_queue.popitem(last=False)
            self._evict(block_id)
            self.ref_cnt[block_id] = 1
            block_ids.append(block_id)
        return block_ids

    def lookup(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               extra: tuple) -> int | None:
        """The cached block with this content, verified against its tokens; None on a miss."""
        block_id = self.cached.get(block_hash)
        if block_id is None or self.block_key[block_id] != (parent_hash, tuple(token_ids), extra):
            return None
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on cached blocks found by lookup (pulls them out of the free queue)."""
        for block_id in block_ids:
            if self.ref_cnt[block_id] == 0:
                del self.free_queue[block_id]
            self.ref_cnt[block_id] += 1

    def commit(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
               extra: tuple) -> bool:
        """Make a full, owned block findable by its hash (first writer wins on duplicates) -> whether it
        was."""
        if self.block_hash[block_id] is not None or block_hash in self.cached:
            return False
        self.block_hash[block_id] = block_hash
        self.block_key[block_id] = (parent_hash, tuple(token_ids), extra)
        self.cached[block_hash] = block_id
        return True

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference each; pass a request's blocks tail first so its tail is evicted first."""
        for block_id in block_ids:
            if block_id == NULL_BLOCK:
                continue
            assert self.ref_cnt[block_id] > 0, f"double free of block {block_id}"
            self.ref_cnt[block_id] -= 1
            if self.ref_cnt[block_id] == 0:
                self.free_queue[block_id] = None

    def drop_cached(self, match: Callable[[tuple], bool]) -> int:
        """Make the free cached blocks whose extra matches unfindable, first in line for reuse -> how many
        (the blocks of an adapter version no request will name again)."""
        keys = self.block_key
        dropped = [b for b in self.free_queue if keys[b] is not None and match(keys[b][2])]
        for block_id in reversed(dropped):
            self._evict(block_id)
            self.free_queue.move_to_end(block_id, last=False)
        return len(dropped)

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hash[block_id]
        if block_hash is not None:
            del self.cached[block_hash]
            self.block_hash[block_id] = None
            self.block_key[block_id] = None
