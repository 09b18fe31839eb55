"""MedusaProposer: drafts from trained Medusa heads (models/proposers/medusa_head.py) over the target's hidden
states.

The engine hands over, after each step, the hidden states of the positions it verified; the last is the
row that produced the request's last token (Proposer.observe_hidden), and head k's argmax at that row is
the draft k + 1 places after that token (head 0 guesses the next one: the target's own LM head gave the
last token itself). A request whose last token came from elsewhere (a resumed or preempted request before
its next forward) has no hidden state for it and drafts nothing that step. With width > 1 it drafts a
token tree (models/proposers/tree_shape.py: head k's top guesses are the tree's level k + 1), verified in
one forward with tree attention. The width is the speculator's choice each step
(scheduling/speculation/tree_policy.py) from what this proposer measures: every proposal's widest tree,
checked once
the tokens that followed it are known (`accepted_counts`); `fixed_width` pins it instead.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from models.model_spec import ModelSpec
from models.proposers.base import Proposer, SpecRequest
from models.proposers.medusa_head import MedusaHeads, load_medusa_heads
from models.proposers.token_tree import TokenTree
from models.proposers.tree_shape import MAX_WIDTH, branching, top_ids, tree_sizes


class MedusaProposer(Proposer):
    needs_hidden = True

    def __init__(self, model_dir: str | Path, spec: ModelSpec, weight_dtype: str,
                 num_heads: int | None = None, fixed_width: int | None = None):
        super().__init__()
        self.width = 1  # this step's: set by the speculator
        self.fixed_width = fixed_width  # None: the policy chooses
        heads = load_medusa_heads(model_dir, spec, weight_dtype)
        if num_heads is not None:
            if num_heads > heads.num_heads:
                raise CheckpointError(f"{model_dir}: num_heads={num_heads} but its Medusa heads file has "
                                      f"{heads.num_heads}; lower num_heads or train more heads")
            heads = MedusaHeads(heads.blocks[:num_heads], heads.projections[:num_heads])
        self.heads = heads
        # one call reads every head's weights once whatever the rows: a share of the target step's fixed cost
        h, v = spec.hidden_size, spec.vocab_size
        head_params = sum(len(blocks) * h * h + v * h for blocks in heads.blocks)
        self.cost_prior = (head_params / spec.num_params, 0.0)
        self._hidden: dict[str, tuple[int, np.ndarray]] = {}  # request id -> (its tokens then, hidden [H])
        K = heads.num_heads
        # [w - 1, l]: trees of width w keeping l
        self.accepted_counts = np.zeros((MAX_WIDTH, K + 1), np.int64)
        self.tree_sizes = tree_sizes(K)
        self._pending: dict[str, list[tuple[int, TokenTree]]] = {}  # request id -> (its tokens, widest tree)

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        # the last feature (position first + n - 1) produced token first + n: the request then had
        # first + n + 1
        self._hidden[request_id] = (first + len(features) + 1, features[-1])

    def free(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)
        self._pending.pop(request_id, None)

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list:
        drafts: list = [[] for _ in requests]
        for req in requests:
            self._measure(req)
        rows = [i for i, (req, depth) in enumerate(zip(requests, depths))
                if depth > 0 and self._hidden.get(req.request_id, (-1,))[0] == len(req.token_ids)]
        if not rows:
            return drafts
        hidden = np.stack([self._hidden[requests[i].request_id][1] for i in rows])  # [R, H]
        ranked = top_ids(self.heads.logits(hidden), MAX_WIDTH)  # [K, R, MAX_WIDTH], best first
        for r, i in enumerate(rows):
            req = requests[i]
            widest = _tree(ranked[:, r])
            self._pending.setdefault(req.request_id, []).append((len(req.token_ids), widest))
            tree = widest.truncated(depths[i]).narrowed(self.width)
            drafts[i] = list(tree.tokens) if self.width == 1 else tree
        return drafts

    def _measure(self, req: SpecRequest) -> None:
        """Count, for each proposal of req whose continuation is known now, the drafts each width's tree
        would have had accepted."""
        pending = self._pending.get(req.request_id)
        if not pending:
            return
        K, tokens = self.heads.num_heads, req.token_ids
        while pending and pending[0][0] + K <= len(tokens):
            n, widest = pending.pop(0)
            for w, kept in enumerate(widest.kept_by_width(tokens[n:n + K], MAX_WIDTH)):
                self.accepted_counts[w, kept] += 1


def _tree(ranked: np.ndarray) -> TokenTree:
    """ranked [K, W]: each head's guesses, best first -> the width-W tree, head k's guesses at level k + 1."""
    tokens, parents, ranks = [], [], []
    frontier = [-1]
    for depth, guesses in enumerate(ranked):
        level = []
        for parent in frontier:
            for rank in range(branching(depth, ranked.shape[1])):
                tokens.append(int(guesses[rank]))
                parents.append(parent)
                ranks.append(rank)
                level.append(len(tokens) - 1)
        frontier = level
    return TokenTree(tuple(tokens), tuple(parents), tuple(ranks))
