"""Per-request KV block bookkeeping over the block pool: prefix hits, slot allocation, accepting a
verification's drafts, commits, frees. It reads the KV cache's KVLayout; the arrays themselves (recent-window
shadows, a verified tree's kept path) are an optional collaborator, left out where nothing is computed."""

import math
from collections.abc import Callable, Iterable, Iterator

from cluster_configs.engine_config import EngineConfig
from kernels.attention.chunks import recent_start
from memory.block_pool import NULL_BLOCK, BlockPool, hash_block
from memory.kv_cache import KVCache, KVLayout, kv_bytes_per_token
from memory.kv_formats import RECENT_GROUP
from models.model_spec import ModelSpec
from scheduling.disk_tier import DiskTier, LoadJob
from scheduling.plan import ScheduledRequest
from scheduling.request import Request


class KVCacheManager:
    def __init__(self, pool: BlockPool, layout: KVLayout, enable_prefix_caching: bool, sliding_window: int,
                 reclaim: Callable[[Callable[[], bool]], bool] = lambda enough: enough(),
                 kv_cache: KVCache | None = None, disk: DiskTier | None = None):
        self.pool = pool
        self.reclaim = reclaim  # frees blocks held elsewhere (idle session sequences) until enough()
        self.layout = layout
        # the arrays (None: bookkeeping alone): their recent-window shadows, a verified tree's kept path
        self.kv_cache = kv_cache
        self.block_size = layout.block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # > 0 only when every layer is windowed
        # the prefix cache's disk tier (None: off), and the requests whose prefix is being read from it
        self.disk = disk
        self.loading: dict[str, LoadJob] = {}

    @property
    def usage(self) -> float:
        """Fraction of the blocks in use."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def stats(self, running: list[Request]) -> dict:
        used_slots = self.pool.num_used_blocks * self.block_size
        stored = sum(r.num_computed_tokens for r in running)
        return {"num_blocks": self.pool.num_blocks, "num_free_blocks": self.pool.num_free_blocks,
                "num_used_blocks": self.pool.num_used_blocks,
                "kv_usage": self.usage,
                # slots holding KV, of those taken
                "kv_utilization": stored / used_slots if used_slots else math.nan,
                "kv_bytes_per_token": self.layout.bytes_per_token,
                # the recent window's bfloat16 shadows (memory/kv_formats.py), outside kv_cache_bytes
                "kv_window_bytes": self.layout.window_bytes}

    def looks_up(self, req: Request) -> bool:
        """Whether req's prompt is looked up in (and its full blocks shared through) the prefix cache."""
        return self.enable_prefix_caching and not req.computes_every_prompt_row

    def find_cached_prefix(self, req: Request) -> list[int]:
        """Cached blocks holding a prefix of req (without taking them); at least one token stays to
        compute."""
        if not self.looks_up(req) or req.block_ids:  # (a session's turn starts from its sequence's blocks)
            return []
        return self._in_pool(req, self.prefix_chain(req))

    def _in_pool(self, req: Request, chain: Iterable[tuple[int, int | None, list[int]]]) -> list[int]:
        """The pool's blocks of chain's leading blocks (prefix_chain's), up to the first it lacks."""
        block_ids: list[int] = []
        for block_hash, parent, tokens in chain:
            block_id = self.pool.lookup(block_hash, parent, tokens, req.cache_extra)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def is_loading(self, req: Request) -> bool:
        """Whether req waits for its prefix to be read from the disk tier."""
        return req.request_id in self.loading

    def start_disk_load(self, req: Request) -> bool:
        """Once per request: if its prompt's full blocks go on past what the pool holds and the next ones
        are on disk, reserve pool blocks for them and start reading them -> whether it did (req then waits:
        is_loading). Never more blocks than are free."""
        if self.disk is None or req.disk_looked_up or not self.looks_up(req) or req.block_ids:
            return False
        req.disk_looked_up = True
        chain = list(self.prefix_chain(req))  # hashed once: the pool's part, then the disk's
        cached = self._in_pool(req, chain)
        keys = [self.disk.key(h, parent, tokens, req.cache_extra)
                for h, parent, tokens in chain[len(cached):]]
        if not keys:
            return False
        num_blocks = min(self.disk.find(keys), self.pool.num_free_blocks - sum(
            1 for b in cached if self.pool.ref_cnt[b] == 0))
        if num_blocks <= 0:
            return False
        self.pool.touch(cached)  # (held while blocks are allocated: the prefix they continue stays)
        block_ids = self.pool.allocate(num_blocks)
        self.pool.free(reversed(cached))
        job = LoadJob(req.request_id, keys[:num_blocks], block_ids, req.cache_extra)
        self.loading[req.request_id] = job
        self.disk.start_load(job)
        return True

    def finish_disk_loads(self) -> None:
        """The blocks read back since the last call join the prefix cache (then their requests find them
        there); a job's blocks that hold nothing go back to the free queue."""
        if self.disk is None:
            return
        for job in self.disk.finished():
            if self.loading.get(job.request_id) is job:
                del self.loading[job.request_id]
            for key, block_id in zip(job.keys[:job.num_loaded], job.block_ids):
                self.pool.commit(block_id, key.block_hash, key.parent_hash, key.token_ids, job.extra)
            self.pool.free(reversed(job.block_ids))

    def waits_on_disk(self, requests) -> bool:
        """Whether every one of requests (an engine's unfinished ones) waits for a disk read still running."""
        return bool(self.loading) and all(r.request_id in self.loading
                                          and not self.loading[r.request_id].done.is_set() for r in requests)

    def allocate_slots(self, req: Request, num_new_tokens: int, cached_block_ids: list[int] = ()) -> bool:
        """Blocks for num_new_tokens more tokens of req (after its cached prefix); False if the pool is
        short."""
        num_computed = req.num_computed_tokens + len(cached_block_ids) * self.block_size
        self._release_out_of_window(req, num_computed)
        num_needed = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = num_needed - len(req.block_ids) - len(cached_block_ids)

        def enough() -> bool:  # cached blocks no one references leave the free queue too
            return self.pool.can_allocate(num_new_blocks + sum(1 for b in cached_block_ids
                                                               if self.pool.ref_cnt[b] == 0))

        if not (enough() or self.reclaim(enough)):
            return False
        if cached_block_ids:
            self.pool.touch(cached_block_ids)
            req.block_ids.extend(cached_block_ids)
            req.num_computed_tokens = num_computed
            req.num_cached_tokens = num_computed
            self._hash_full_blocks(req)
        if num_new_blocks > 0:
            req.block_ids.extend(self.pool.allocate(num_new_blocks))
        if req.wide_from is None:
            req.wide_from = num_computed
        self.sync_shadows(req, num_computed + num_new_tokens)
        return True

    def accept(self, scheduled: ScheduledRequest, num_accepted: int, kept_rows: list[int]) -> None:
        """After the step's tokens were appended to the request: its KV holds what was verified. A tree's kept
        path moves to the slots after its root, rejected drafts' blocks go back, full blocks are committed.
        kept_rows: the rows its tokens were sampled at (0: the root, 1 + i: node i)."""
        req, num_drafts = scheduled.request, len(scheduled.draft_token_ids)
        first = req.num_computed_tokens + scheduled.num_base_tokens  # the first draft's slot
        if num_accepted and scheduled.tree is not None and self.kv_cache is not None:
            nodes = [r - 1 for r in kept_rows[1:]]
            self.kv_cache.move_slots(req.block_ids, [first + v for v in nodes],
                                     list(range(first, first + len(nodes))))
        req.num_computed_tokens = min(first + num_accepted, req.num_tokens)
        self.sync_shadows(req, req.num_computed_tokens)
        if num_drafts:
            self.rollback(req)
        self.commit_full_blocks(req)

    def sync_shadows(self, req: Request, end: int) -> None:
        """The recent window's shadows on exactly req's blocks a token of it reads wide up to slot end: from
        the window of its next position (req.num_computed_tokens) on, none before req.wide_from (before
        the blocks go back to the pool, or a step writes slots below end)."""
        if self.kv_cache is None or not self.kv_cache.windowed:
            return
        bs = self.block_size
        first = max(req.wide_from or 0, recent_start(req.num_computed_tokens, RECENT_GROUP))
        wanted = {req.block_ids[i] for i in range(first // bs, min(-(-end // bs), len(req.block_ids)))
                  if req.block_ids[i] != NULL_BLOCK} if end > first else set()
        for block in req.shadowed - wanted:
            self.kv_cache.release_shadow(block)
        for block in wanted - req.shadowed:
            self.kv_cache.attach_shadow(block)
        req.shadowed = wanted

    def commit_full_blocks(self, req: Request) -> None:
        """After a step: make req's newly filled blocks findable by later requests."""
        start = len(req.block_hashes)
        self._hash_full_blocks(req)
        if self.enable_prefix_caching:
            for i in range(start, len(req.block_hashes)):
                if req.block_ids[i] != NULL_BLOCK:
                    parent = req.block_hashes[i - 1] if i else None
                    tokens = req.token_ids[i * self.block_size:(i + 1) * self.block_size]
                    block_id, block_hash = req.block_ids[i], req.block_hashes[i]
                    if self.pool.commit(block_id, block_hash, parent, tokens, req.cache_extra) and self.disk:
                        self.disk.save(self.disk.key(block_hash, parent, tokens, req.cache_extra), block_id)

    def rollback(self, req: Request) -> None:
        """After verification moved req.num_computed_tokens back over rejected drafts: return the blocks
        that hold only their KV to the pool, tail first (they were never committed: only full blocks of
        verified tokens are). The stale slots left in the last kept block are overwritten later."""
        num_kept = -(-req.num_computed_tokens // self.block_size)
        if len(req.block_ids) > num_kept:
            self.pool.free(reversed(req.block_ids[num_kept:]))
            del req.block_ids[num_kept:]

    def free(self, req: Request) -> None:
        self.sync_shadows(req, 0)
        req.wide_from = None
        self.pool.free(reversed(req.block_ids))  # tail first: the tail is the least likely to be shared
        req.block_ids = []
        req.block_hashes = []
        req.num_computed_tokens = 0

    def prefix_chain(self, req: Request) -> Iterator[tuple[int, int | None, list[int]]]:
        """(hash, parent hash, tokens) of each full block of req's tokens but the last token (at least one
        token stays to compute), hashed as they are asked for."""
        parent, bs = None, self.block_size
        for i in range((req.num_tokens - 1) // bs):
            tokens = req.token_ids[i * bs:(i + 1) * bs]
            block_hash = hash_block(parent, tokens, req.cache_extra)
            yield block_hash, parent, tokens
            parent = block_hash

    def _hash_full_blocks(self, req: Request) -> None:
        bs = self.block_size
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            parent = req.block_hashes[i - 1] if i else None
            req.block_hashes.append(hash_block(parent, req.token_ids[i * bs:(i + 1) * bs], req.cache_extra))

    def _release_out_of_window(self, req: Request, num_computed: int) -> None:
        # the next token to compute is at position num_computed and looks back sliding_window positions
        if self.sliding_window <= 0:
            return
        first_needed = max(0, num_computed - self.sliding_window + 1)
        for i in range(min(first_needed // self.block_size, len(req.block_ids))):
            if req.block_ids[i] != NULL_BLOCK:
                self.pool.free([req.block_ids[i]])
                req.block_ids[i] = NULL_BLOCK


def num_kv_blocks(spec: ModelSpec, config: EngineConfig, max_model_len: int) -> int:
    """The KV pool's size: what kv_cache_bytes holds, but no more than max_num_seqs requests of
    max_model_len."""
    bs = config.block_size
    block_bytes = kv_bytes_per_token(spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                     config.resolved_kv_dtype, config.kv_dtype_overrides) * bs
    num_blocks = min(config.kv_cache_bytes // block_bytes, config.max_num_seqs * -(-max_model_len // bs))
    if num_blocks < 1:
        raise ValueError(f"kv_cache_bytes={config.kv_cache_bytes} cannot hold one KV block of {block_bytes} "
                         "bytes; raise kv_cache_bytes or lower block_size")
    return num_blocks


def window_shadows(config: EngineConfig) -> int:
    """Blocks that can carry a recent-window shadow at once: a request's from the window of its next
    position (RECENT_GROUP to 2 RECENT_GROUP - 1 slots back) to the end of its step's slots, max_num_seqs of
    them, their new slots no more than max_num_batched_tokens (drafts included). Allocated only when a layer's
    format keeps a window; its pages are taken as shadows are first written."""
    bs = config.block_size
    return -(-config.max_num_batched_tokens // bs) + config.max_num_seqs * (-(-2 * RECENT_GROUP // bs) + 2)
