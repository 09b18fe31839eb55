"""EagleProposer: drafts with an EAGLE head (models/eagle.py) over the target's own features.

The engine hands over, after each step, the target's final-norm features of every row it computed for a
request's verified tokens (Proposer.observe_hidden: f_p for positions first .. first + n - 1). Per request
this proposer keeps the head's KV for the positions it has run with true features, and the features it
has not run yet. A call first runs every request's unseen positions p (inputs t_{p+1}, f_p) up to the
newest feature in one catch-up forward whose last row guesses the next token; then one forward per
further draft position feeds each guess back with the head's own feature guess. The KV those draft
positions wrote is dropped on the next call (its features were guesses): the catch-up overwrites it.
A request whose features have a gap (none for some positions) drafts nothing until it is recomputed.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memory.block_pool import BlockPool
from memory.kv_cache import KVCache
from models.batch import ForwardBatch
from models.eagle import EagleHead, eagle_spec, load_eagle_head
from models.proposers.base import Proposer, SpecRequest
from models.spec import ModelSpec

SPARE_BLOCKS = 64  # beyond the target's KV capacity: draft positions past a request's verified tokens


@dataclass
class _EagleSeq:
    num_done: int = 0  # positions whose head KV holds true features
    features: list[np.ndarray] = field(default_factory=list)  # f_p for p = num_done, num_done + 1, ...
    block_ids: list[int] = field(default_factory=list)

    @property
    def next_feature(self) -> int:
        return self.num_done + len(self.features)


class EagleProposer(Proposer):
    needs_hidden = True
    catches_up = True  # a request that stopped drafting runs its missed positions through the head's layer

    def __init__(self, model_dir: str | Path, spec: ModelSpec, target_weights: dict, weight_dtype: str, *,
                 kv_cache_tokens: int, block_size: int = 16, kv_dtype: str = "float32"):
        super().__init__()
        self.head: EagleHead = load_eagle_head(model_dir, spec, target_weights, weight_dtype)
        self.block_size = block_size
        num_blocks = -(-kv_cache_tokens // block_size) + SPARE_BLOCKS
        s = eagle_spec(spec)
        self.kv_cache = KVCache(1, num_blocks, block_size, s.num_kv_heads, s.head_dim, kv_dtype)
        self.pool = BlockPool(num_blocks)
        # a pass: one layer of the target's and its LM head (the target's own, read again)
        layer = spec.num_params - spec.vocab_size * spec.hidden_size
        self.cost_prior = (1 / spec.num_layers, (layer / spec.num_layers + spec.vocab_size * spec.hidden_size)
                           / spec.num_params)
        self.seqs: dict[str, _EagleSeq] = {}

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        seq = self.seqs.setdefault(request_id, _EagleSeq())
        if first < seq.next_feature:  # recomputed (after a preemption): keep what precedes it
            self._truncate(seq, min(seq.num_done, first))
            del seq.features[first - seq.num_done:]
        if first > seq.next_feature:  # a gap: nothing to catch up from until the request is recomputed
            self._truncate(seq, 0)
            seq.features.clear()
            return
        seq.features += list(features)

    def free(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.block_ids))

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        self.last_passes = []
        drafts: list[list[int]] = [[] for _ in requests]
        # a request drafts when the head has features up to its last verified token's producer (n - 2)
        feeds = []  # (request index, positions' tokens t_{p+1}, features f_p, first position)
        for i, (req, depth) in enumerate(zip(requests, depths)):
            seq = self.seqs.get(req.request_id)
            n = len(req.token_ids)
            if depth <= 0 or seq is None or seq.next_feature != n - 1 or n < 2:
                continue
            self._truncate(seq, seq.num_done)  # the last call's draft positions
            new = range(seq.num_done, n - 1)
            feeds.append((i, [req.token_ids[p + 1] for p in new], np.array(seq.features), seq.num_done))
        for step in range(max((depths[i] for i, *_ in feeds), default=0)):
            feeds = [f for f in feeds if self._reserve(self.seqs[requests[f[0]].request_id], f[3] + len(f[1]))]
            if not feeds:
                break
            start = time.perf_counter()
            logits, guesses = self._forward([(self.seqs[requests[i].request_id], t, f, p) for i, t, f, p in feeds])
            self.last_passes.append((sum(len(t) for _, t, *_ in feeds), time.perf_counter() - start))
            if step == 0:  # the catch-up ran every true feature: those positions are done
                for i, tokens, _, first in feeds:
                    seq = self.seqs[requests[i].request_id]
                    seq.num_done, seq.features = first + len(tokens), []
            next_feeds = []
            for (i, tokens, _, first), row, guess in zip(feeds, logits, guesses):
                token = int(np.argmax(row))
                drafts[i].append(token)
                if len(drafts[i]) < depths[i]:
                    next_feeds.append((i, [token], guess[None], first + len(tokens)))
            feeds = next_feeds
        return drafts

    # ---- helpers ----------------------------------------------------------------------------------

    def _truncate(self, seq: _EagleSeq, keep: int) -> None:
        """Keep the KV of positions < keep."""
        seq.num_done = min(seq.num_done, keep)
        num_blocks = -(-keep // self.block_size)
        self.pool.free(reversed(seq.block_ids[num_blocks:]))
        del seq.block_ids[num_blocks:]

    def _reserve(self, seq: _EagleSeq, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need) if self.pool.can_allocate(need) else None
        if blocks is None:
            return False  # no room this step: no draft (its state stays)
        seq.block_ids += blocks
        return True

    def _forward(self, feeds: list[tuple[_EagleSeq, list[int], np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
        """Run each feed's positions (tokens t_{p+1}, features f_p, from its first position) through the head;
        -> logits [len(feeds), V] and feature guesses [len(feeds), H] of each feed's last row."""
        bs = self.block_size
        token_ids, positions, token_seq, last_rows, features = [], [], [], [], []
        block_tables = np.zeros((len(feeds), max(len(seq.block_ids) for seq, *_ in feeds)), np.int32)
        for s, (seq, tokens, feats, first) in enumerate(feeds):
            token_ids += tokens
            positions += range(first, first + len(tokens))
            token_seq += [s] * len(tokens)
            last_rows.append(len(token_ids) - 1)
            features.append(feats)
            block_tables[s, :len(seq.block_ids)] = seq.block_ids
        positions = np.asarray(positions, np.int32)
        token_seq = np.asarray(token_seq, np.int32)
        slot_mapping = block_tables[token_seq, positions // bs].astype(np.int64) * bs + positions % bs
        last_rows = np.asarray(last_rows, np.int64)
        batch = ForwardBatch(np.asarray(token_ids, np.int64), positions, token_seq, slot_mapping, block_tables,
                             last_rows, hidden_indices=last_rows)
        return self.head.forward(batch, self.kv_cache, np.concatenate(features).astype(np.float32))
