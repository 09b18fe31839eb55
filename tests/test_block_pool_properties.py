"""Invariants of the block pool under random allocate / append / free / cache-hit / evict sequences."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import BlockPool
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.request import Request

NUM_BLOCKS, BLOCK_SIZE = 10, 2
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny alphabet: prefixes repeat


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        self.kv = KVCacheManager(self.pool, BLOCK_SIZE, enable_prefix_caching=True, sliding_window=0)
        self.live: list[Request] = []
        self.content: dict[int, tuple] = {}  # block id -> the tokens whose KV was written there
        self.count = 0

    def _compute(self, req: Request, num_new: int) -> None:
        """What a model step does: write KV for the new tokens, then commit full blocks."""
        start = req.num_computed_tokens
        for pos in range(start, start + num_new):
            block = req.block_ids[pos // BLOCK_SIZE]
            prev = self.content.get(block, ()) if pos % BLOCK_SIZE else ()
            self.content[block] = prev + (req.token_ids[pos],)
        req.num_computed_tokens += num_new
        self.kv.commit_full_blocks(req)

    @rule(prompt=tokens, salt=st.sampled_from([None, "a"]))
    def add_request(self, prompt, salt):
        self.count += 1
        req = Request(f"r{self.count}", prompt, SamplingParams(), cache_salt=salt, max_model_len=100)
        cached = self.kv.find_cached_prefix(req)
        for i, block in enumerate(cached):  # a hit must hold exactly this request's tokens
            assert self.content[block] == tuple(prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        num_new = req.num_tokens - len(cached) * BLOCK_SIZE
        if self.kv.allocate_slots(req, num_new, cached):
            self._compute(req, num_new)
            self.live.append(req)
        else:
            assert req.block_ids == [] and req.num_computed_tokens == 0

    @rule(data=st.data(), token=st.integers(0, 2))
    def append_token(self, data, token):
        if not self.live:
            return
        req = data.draw(st.sampled_from(self.live))
        req.token_ids.append(token)
        if self.kv.allocate_slots(req, 1):
            self._compute(req, 1)
        else:  # the scheduler would preempt: free and recompute later
            self.kv.free(req)
            self.live.remove(req)

    @rule(data=st.data())
    def finish(self, data):
        if self.live:
            req = data.draw(st.sampled_from(self.live))
            self.kv.free(req)
            self.live.remove(req)

    @invariant()
    def ref_counts_match_owners(self):
        owners = Counter(b for r in self.live for b in r.block_ids)
        for block in range(NUM_BLOCKS):
            assert self.pool.ref_cnt[block] >= 0
            assert self.pool.ref_cnt[block] == owners[block]
            assert (block in self.pool.free_queue) == (owners[block] == 0)

    @invariant()
    def shared_blocks_are_cached_prefixes_of_every_owner(self):
        owners = Counter(b for r in self.live for b in r.block_ids)
        for block, n in owners.items():
            if n > 1:  # one block, several owners: only through a verified prefix-cache hit
                assert self.pool.is_cached(block)
        for r in self.live:
            for i, block in enumerate(r.block_ids[: r.num_computed_tokens // BLOCK_SIZE]):
                assert self.content[block] == tuple(r.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])

    @invariant()
    def hash_map_is_consistent(self):
        for block_hash, block in self.pool.cached.items():
            assert self.pool.block_hash[block] == block_hash

    def teardown(self):
        for req in self.live:
            self.kv.free(req)
        assert self.pool.num_free_blocks == NUM_BLOCKS
        assert all(c == 0 for c in self.pool.ref_cnt)


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=300, stateful_step_count=40, deadline=None)


def test_free_queue_hands_out_least_recently_freed_first():
    pool = BlockPool(4)
    a = pool.allocate(4)
    pool.free([a[2], a[0]])
    pool.free([a[3]])
    assert pool.allocate(3) == [a[2], a[0], a[3]]
    assert pool.allocate(1) is None and pool.num_free_blocks == 0
