"""Invariants of the block pool under random allocate / append / free / cache-hit / evict sequences, and
speculative steps whose rejected drafts roll back (no leak, no double free, hashes only on verified
blocks)."""

from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cluster_configs.sampling_params import SamplingParams
from memory.block_pool import BlockPool
from memory.kv_cache import kv_layout
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.request import Request

NUM_BLOCKS, BLOCK_SIZE = 10, 2
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=9)  # a tiny alphabet: prefixes repeat


class BlockPoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS)
        layout = kv_layout(1, NUM_BLOCKS, BLOCK_SIZE, 1, 1, "float32")  # bookkeeping only: no arrays
        self.kv = KVCacheManager(self.pool, layout, enable_prefix_caching=True, sliding_window=0)
        self.live: list[Request] = []
        self.content: dict[int, list] = {}  # block id -> the token whose KV was written in each slot
        self.count = 0

    def _write(self, req: Request, start: int, token_ids: list[int]) -> None:
        """What the model does: write KV of token_ids at positions start, start + 1, ... (slot by slot)."""
        for pos, token in enumerate(token_ids, start):
            self.content.setdefault(req.block_ids[pos // BLOCK_SIZE],
                                    [None] * BLOCK_SIZE)[pos % BLOCK_SIZE] = token

    def _compute(self, req: Request, num_new: int) -> None:
        """A plain step: write KV for the new tokens, then commit full blocks."""
        start = req.num_computed_tokens
        self._write(req, start, req.token_ids[start:start + num_new])
        req.num_computed_tokens += num_new
        self.kv.commit_full_blocks(req)

    @rule(prompt=tokens, salt=st.sampled_from([None, "a"]))
    def add_request(self, prompt, salt):
        self.count += 1
        req = Request(f"r{self.count}", prompt, SamplingParams(), cache_salt=salt, max_model_len=100)
        cached = self.kv.find_cached_prefix(req)
        for i, block in enumerate(cached):  # a hit must hold exactly this request's tokens
            assert self.content[block] == prompt[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]
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
        num_new = req.num_tokens - req.num_computed_tokens
        if self.kv.allocate_slots(req, num_new):
            self._compute(req, num_new)
        else:  # the scheduler would preempt: free and recompute later
            self.kv.free(req)
            self.live.remove(req)

    @rule(data=st.data(), token=st.integers(0, 2), drafts=st.lists(st.integers(0, 2), min_size=1, max_size=5))
    def speculate(self, data, token, drafts):
        """A verification step: the last token and its drafts get KV; the target accepts a prefix of the
        drafts and appends its own next token; the rejected drafts' KV rolls back."""
        if not self.live:
            return
        req = data.draw(st.sampled_from(self.live))
        req.token_ids.append(token)
        start, num_base = req.num_computed_tokens, req.num_tokens - req.num_computed_tokens
        num_free_before = self.pool.num_free_blocks + len(req.block_ids)
        if not self.kv.allocate_slots(req, num_base + len(drafts)):
            return  # drafts never preempt: the engine schedules the step without them
        self._write(req, start, req.token_ids[start:] + drafts)
        num_accepted = data.draw(st.integers(0, len(drafts)))
        target = drafts[num_accepted] + 1 if num_accepted < len(drafts) else data.draw(st.integers(0, 2))
        req.token_ids += drafts[:num_accepted] + [target % 3]
        req.num_computed_tokens = start + num_base + num_accepted
        self.kv.rollback(req)
        self.kv.commit_full_blocks(req)
        assert len(req.block_ids) == -(-req.num_computed_tokens // BLOCK_SIZE)  # the tail went back
        assert self.pool.num_free_blocks + len(req.block_ids) == num_free_before

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
                assert self.pool.block_hash[block] is not None
        for r in self.live:
            for i, block in enumerate(r.block_ids[: r.num_computed_tokens // BLOCK_SIZE]):
                assert self.content[block] == r.token_ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]

    @invariant()
    def requests_hold_blocks_for_computed_tokens_only(self):
        for r in self.live:
            assert len(r.block_ids) == -(-r.num_computed_tokens // BLOCK_SIZE)
            assert len(r.block_hashes) == r.num_computed_tokens // BLOCK_SIZE

    @invariant()
    def hash_map_is_consistent(self):
        for block_hash, block in self.pool.cached.items():
            assert self.pool.block_hash[block] == block_hash

    @invariant()
    def cached_blocks_hold_exactly_their_verified_tokens(self):
        for block in self.pool.cached.values():  # never a rejected draft's slot
            assert self.content[block] == list(self.pool.block_key[block][1])

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
