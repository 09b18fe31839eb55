"""EagleProposer: drafts with an EAGLE head (models/proposers/eagle_head.py) over the target's own features.

The engine hands over, after each step, the target's final-norm features of every row it computed for a
request's verified tokens (Proposer.observe_hidden: f_p for positions first .. first + n - 1). Per request
this proposer keeps the head's KV for the positions it has run with true features, and the features it
has not run yet. A call first runs every request's unseen positions p (inputs t_{p+1}, f_p) up to the
newest feature in one catch-up forward whose last row (the root) ranks the next token; then one forward
per further tree level feeds each guess back with its parent's feature guess. Width 1 drafts a chain;
wider, a token tree (models/proposers/tree_shape.py) whose nodes take the head's KV slots after the
root's and see their ancestors through the tree mask, as the target verifies them. The KV those draft
nodes wrote is dropped on the next call (their features were guesses): the catch-up overwrites it.
The head runs a request from its first feature on: a prompt whose prefix came from the prefix cache has no
features for that prefix (the target did not compute it), so the head starts after it, its positions
shifted to start at 0 there (under RoPE attention depends on relative positions only); it misses the
prefix's tokens in its own attention, not in the target's features. A later gap (positions the target
skipped) restarts it the same way, and so does a request that has not drafted for MAX_UNSEEN positions.

Widths are measured as Medusa's are: every proposal's tree, once the tokens that followed it are known,
tells what each narrower tree would have kept (`accepted_counts`); wider trees than the step's width are
drafted for the first MIN_MEASURED proposals and then one in EXPLORE_EVERY, so every width stays
measured (a proposal's counts reach no deeper than it drafted).
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memory.block_pool import BlockPool
from memory.kv_cache import KVCache
from memory.weights import ModelWeights
from models.batch import ForwardBatch
from models.model_spec import ModelSpec
from models.proposers.base import Proposer, SpecRequest
from models.proposers.eagle_head import EagleHead, eagle_spec, load_eagle_head
from models.proposers.token_tree import TokenTree
from models.proposers.tree_shape import MAX_WIDTH, MIN_MEASURED, branching, top_ids, tree_sizes

SPARE_BLOCKS = 64  # beyond the target's KV capacity: draft positions past a request's verified tokens
EXPLORE_EVERY = 16  # after the first MIN_MEASURED proposals, one in this many drafts the widest tree
# a request's features not yet run through the head are kept up to MAX_UNSEEN (H floats each), then the
# head restarts from the newest RESTART_KEEP: a request that does not draft for long (another method
# drafts, or none) holds bounded memory, and drafting again catches up on RESTART_KEEP positions at most
MAX_UNSEEN, RESTART_KEEP = 512, 128


@dataclass
class _EagleSeq:
    start: int  # the first position the head has run (its KV slot 0); positions are the request's
    num_done: int  # positions < num_done have head KV from true features
    features: list[np.ndarray] = field(default_factory=list)  # f_p for p = num_done, num_done + 1, ...
    block_ids: list[int] = field(default_factory=list)

    @property
    def next_feature(self) -> int:
        return self.num_done + len(self.features)


@dataclass
class _Growing:
    """A request's tree while it is drafted: nodes in level order, each node's feature guess once run."""
    index: int  # the request's in this call
    seq: _EagleSeq
    root: int  # the root row's position (n - 2); node i's head KV slot is root + 1 + i
    width: int
    depth: int
    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    ranks: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)
    guesses: dict[int, np.ndarray] = field(default_factory=dict)  # node (-1: the root) -> its feature guess

    def grow(self, parent: int, ranked: np.ndarray, guess: np.ndarray) -> None:
        """Children of parent (-1: the root) from its row's best token ids ranked [MAX_WIDTH]; guess [H]: its
        feature guess."""
        self.guesses[parent] = guess
        level = 1 if parent < 0 else self.depths[parent] + 1
        for rank, token in enumerate(ranked[:branching(level - 1, self.width)]):
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.ranks.append(rank)
            self.depths.append(level)

    def tree(self) -> TokenTree:
        return TokenTree(tuple(self.tokens), tuple(self.parents), tuple(self.ranks))


class EagleProposer(Proposer):
    needs_hidden = True
    catches_up = True  # a request that stopped drafting runs its missed positions through the head's layer

    def __init__(self, model_dir: str | Path, spec: ModelSpec, target_weights: ModelWeights,
                 weight_dtype: str, *, kv_cache_tokens: int, block_size: int = 16, kv_dtype: str = "float32",
                 max_depth: int = 4, fixed_width: int | None = None, activation_dtype: str = "float32",
                 max_model_len: int | None = None):
        super().__init__()
        self.head: EagleHead = load_eagle_head(model_dir, spec, target_weights, weight_dtype,
                                               activation_dtype, max_model_len)
        self.block_size = block_size
        num_blocks = -(-(kv_cache_tokens + tree_sizes(max_depth).max()) // block_size) + SPARE_BLOCKS
        s = eagle_spec(spec)
        self.kv_cache = KVCache(1, num_blocks, block_size, s.num_kv_heads, s.head_dim, kv_dtype)
        self.pool = BlockPool(num_blocks)
        # a tree node sees all its ancestors: a windowed head layer keeps trees inside its window
        self.max_tree_depth = s.layer_windows[0] - 1 if s.layer_windows[0] > 0 else max_depth
        # a pass: one layer of the target's and its LM head (the target's own, read again: the draft
        # vocabulary's rows of it)
        layer = spec.num_params - spec.vocab_size * spec.hidden_size
        vocab = spec.vocab_size if self.head.draft_ids is None else len(self.head.draft_ids)
        self.cost_prior = (1 / spec.num_layers,
                           (layer / spec.num_layers + vocab * spec.hidden_size) / spec.num_params)
        self.seqs: dict[str, _EagleSeq] = {}
        self.width = 1  # this step's: set by the speculator
        self.fixed_width = fixed_width  # None: the policy chooses
        self.accepted_counts = np.zeros((MAX_WIDTH, max_depth + 1), np.int64)  # [w - 1, l]
        self.tree_sizes = tree_sizes(max_depth)
        self._pending: dict[str, list[tuple[int, TokenTree, int]]] = {}  # id -> (its tokens, tree, its width)
        self._num_proposals = 0

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        seq = self.seqs.get(request_id)
        if seq is None or not seq.start <= first <= seq.next_feature:  # new, or restarted (module docstring)
            if seq is not None:
                self._truncate(seq, seq.start)
            seq = self.seqs[request_id] = _EagleSeq(first, first)
        elif first < seq.next_feature:  # recomputed (after a preemption): keep what precedes it
            self._truncate(seq, min(seq.num_done, first))
            del seq.features[first - seq.num_done:]
        seq.features += list(features)
        if len(seq.features) > MAX_UNSEEN:  # not drafting for long (method auto chose another): restart
            self._truncate(seq, seq.start)  # from the newest RESTART_KEEP features, as after a prefix hit
            self.seqs[request_id] = _EagleSeq(seq.next_feature - RESTART_KEEP,
                                              seq.next_feature - RESTART_KEEP, seq.features[-RESTART_KEEP:])

    def free(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.pool.free(reversed(seq.block_ids))

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list:
        self.last_passes = []
        drafts: list = [[] for _ in requests]
        for req in requests:
            self._measure(req)
        # a request drafts when the head has features up to its last verified token's producer (n - 2)
        feeds = []  # (its tokens t_{p+1}, features f_p, first position p) per request drafting
        growing: list[_Growing] = []
        for i, (req, depth) in enumerate(zip(requests, depths)):
            seq = self.seqs.get(req.request_id)
            n = len(req.token_ids)
            if depth <= 0 or seq is None or seq.next_feature != n - 1 or n < 2:
                continue
            self._truncate(seq, seq.num_done)  # the last call's draft nodes
            if not self._reserve(seq, n - 1):
                continue
            new = range(seq.num_done, n - 1)
            feeds.append(([req.token_ids[p + 1] for p in new], np.array(seq.features), seq.num_done))
            # an exploring proposal's head drafts the widest tree; the target still verifies this step's width
            width = self.fixed_width or (MAX_WIDTH if self._explores() else self.width)
            growing.append(_Growing(i, seq, n - 2, width,
                                    depth if width == 1 else min(depth, self.max_tree_depth)))
        if not feeds:
            return drafts
        logits, guesses = self._timed(self._catch_up, growing, feeds)
        for g, (tokens, _, first), row, guess in zip(growing, feeds, self._ranked(logits), guesses):
            g.seq.num_done, g.seq.features = first + len(tokens), []  # every true feature has run
            g.grow(-1, row, guess)
        for level in range(1, max(g.depth for g in growing)):
            runs = []  # (a tree, its nodes at this level): each runs to rank its children
            for g in growing:
                nodes = [i for i, d in enumerate(g.depths) if d == level] if g.depth > level else []
                if nodes and self._reserve(g.seq, g.root + 2 + nodes[-1]):
                    runs.append((g, nodes))
                else:
                    g.depth = min(g.depth, level)  # no room for its next level this step
            if not runs:
                break
            logits, guesses = self._timed(self._run_level, runs)
            rows = iter(zip(self._ranked(logits), guesses))
            for g, nodes in runs:
                for node in nodes:
                    g.grow(node, *next(rows))
        for g in growing:
            tree = g.tree().truncated(g.depth)
            req = requests[g.index]
            self._pending.setdefault(req.request_id, []).append((len(req.token_ids), tree, g.width))
            drafted = tree.narrowed(self.fixed_width or self.width)
            drafts[g.index] = list(drafted.tokens) if drafted.is_chain else drafted
        return drafts

    # ---- helpers ----------------------------------------------------------------------------------

    def _explores(self) -> bool:
        """Whether this proposal drafts the widest tree to measure every width (module docstring)."""
        self._num_proposals += 1
        return self._num_proposals <= MIN_MEASURED or self._num_proposals % EXPLORE_EVERY == 0

    def _measure(self, req: SpecRequest) -> None:
        """Count, for each proposal of req whose continuation is known now, the drafts each width up to the
        one it drafted would have had accepted."""
        pending = self._pending.get(req.request_id)
        tokens = req.token_ids
        while pending and pending[0][0] + max(pending[0][1].depths, default=0) <= len(tokens):
            n, tree, width = pending.pop(0)
            depth = max(tree.depths, default=0)
            for w, kept in enumerate(tree.kept_by_width(tokens[n:n + depth], width)):
                self.accepted_counts[w, kept] += 1

    def _ranked(self, logits: np.ndarray) -> np.ndarray:
        """logits [R, Vd] -> each row's best MAX_WIDTH target token ids, best first [R, MAX_WIDTH]."""
        return self.head.target_ids(top_ids(logits, MAX_WIDTH))

    def _timed(self, run, *args) -> tuple[np.ndarray, np.ndarray]:
        """run(*args) -> its logits and feature guesses; its rows and seconds are a pass (last_passes)."""
        start = time.perf_counter()
        logits, guesses = run(*args)
        self.last_passes.append((len(logits), time.perf_counter() - start))
        return logits, guesses

    def _truncate(self, seq: _EagleSeq, keep: int) -> None:
        """Keep the KV of positions < keep."""
        seq.num_done = min(seq.num_done, keep)
        num_blocks = -(-(keep - seq.start) // self.block_size)
        self.pool.free(reversed(seq.block_ids[num_blocks:]))
        del seq.block_ids[num_blocks:]

    def _reserve(self, seq: _EagleSeq, end: int) -> bool:
        """Blocks for the head's KV of positions < end."""
        need = -(-(end - seq.start) // self.block_size) - len(seq.block_ids)
        if need <= 0:
            return True
        blocks = self.pool.allocate(need) if self.pool.can_allocate(need) else None
        if blocks is None:
            return False  # no room this step: no draft (its state stays)
        seq.block_ids += blocks
        return True

    def _catch_up(self, growing: list[_Growing], feeds: list) -> tuple[np.ndarray, np.ndarray]:
        """Each request's unseen positions p (tokens t_{p+1}, features f_p) -> logits [R, V] and feature
        guesses [R, H] of each one's last row, the root."""
        rows = _Rows()
        for g, (tokens, features, first) in zip(growing, feeds):
            s = rows.add_sequence(g.seq)
            for j, token in enumerate(tokens):
                rows.add(s, token, first + j, first + j, features[j], wanted=j == len(tokens) - 1)
        return self._forward(rows)

    def _run_level(self, runs: list[tuple[_Growing, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """Each tree's nodes of one level, with their parents' feature guesses, in the KV slots after the
        root's, seeing their ancestors -> logits [R, V] and feature guesses [R, H], a row per node."""
        rows = _Rows()
        width = max(len(g.tokens) for g, _ in runs)
        for g, nodes in runs:
            s = rows.add_sequence(g.seq)
            mask = g.tree().mask(width)
            for node in nodes:
                rows.add(s, g.tokens[node], g.root + g.depths[node], g.root + 1 + node,
                         g.guesses[g.parents[node]], wanted=True, tree_start=g.root + 1, tree_row=mask[node])
        return self._forward(rows, width)

    def _forward(self, rows: "_Rows", tree_width: int = 0) -> tuple[np.ndarray, np.ndarray]:
        bs = self.block_size
        block_tables = np.zeros((len(rows.seqs), max(len(seq.block_ids) for seq in rows.seqs)), np.int32)
        for s, seq in enumerate(rows.seqs):
            block_tables[s, :len(seq.block_ids)] = seq.block_ids
        token_seq = np.asarray(rows.token_seq, np.int32)
        slots = np.asarray(rows.slots, np.int64)
        slot_mapping = block_tables[token_seq, slots // bs].astype(np.int64) * bs + slots % bs
        wanted = np.asarray(rows.wanted, np.int64)
        tree_starts = tree_mask = None
        if tree_width:
            tree_starts = np.asarray(rows.tree_starts, np.int32)
            tree_mask = np.stack(rows.tree_rows)
        batch = ForwardBatch(np.asarray(rows.token_ids, np.int64), np.asarray(rows.positions, np.int32),
                             token_seq, slot_mapping, block_tables, wanted, hidden_indices=wanted,
                             tree_starts=tree_starts, tree_mask=tree_mask)
        return self.head.forward(batch, self.kv_cache, np.stack(rows.features).astype(np.float32))


@dataclass
class _Rows:
    """One head forward's rows, built up per sequence."""
    seqs: list[_EagleSeq] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    token_seq: list[int] = field(default_factory=list)
    features: list[np.ndarray] = field(default_factory=list)
    wanted: list[int] = field(default_factory=list)  # rows whose logits and feature guesses are returned
    tree_starts: list[int] = field(default_factory=list)
    tree_rows: list[np.ndarray] = field(default_factory=list)

    def add_sequence(self, seq: _EagleSeq) -> int:
        self.seqs.append(seq)
        return len(self.seqs) - 1

    def add(self, s: int, token: int, position: int, slot: int, feature: np.ndarray, *, wanted: bool,
            tree_start: int = -1, tree_row: np.ndarray | None = None) -> None:
        """A row of sequence s at the request's position, in the KV slot of the request's position `slot`
        (a tree node's: after the root's, as tree_start): both taken from the head's start."""
        start = self.seqs[s].start
        if wanted:
            self.wanted.append(len(self.token_ids))
        self.token_ids.append(token)
        self.positions.append(position - start)
        self.slots.append(slot - start)
        self.token_seq.append(s)
        self.features.append(feature)
        self.tree_starts.append(tree_start - start if tree_start >= 0 else -1)
        self.tree_rows.append(tree_row)
