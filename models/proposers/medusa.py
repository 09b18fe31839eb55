"""MedusaProposer: drafts from trained Medusa heads (models/medusa.py) over the target's hidden states.

The engine hands over, after each step, the hidden states of the positions it verified; the last is the
row that produced the request's last token (Proposer.observe_hidden), and head k's argmax at that row is
the draft k + 1 places after that token (the target's own LM head gave the token itself). A request
whose last token came from elsewhere (a resumed or preempted request before its next forward) has no
hidden state for it and drafts nothing that step. With width > 1 it drafts a token tree: the top-`width` guesses of the first two heads (every pair)
and each later head's best guess under each pair, verified in one forward with tree attention. The width
is the speculator's choice each step (scheduling/tree_policy.py) from what this proposer measures: for
each proposal whose continuation is known, the drafts a tree of each width up to MAX_WIDTH would have had
accepted (`accepted_counts`), and its size (`tree_sizes`); `fixed_width` pins it instead.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from models.medusa import MedusaHeads, load_medusa_heads
from models.proposers.base import Proposer, SpecRequest
from models.spec import ModelSpec
from models.token_tree import TokenTree

MAX_WIDTH = 4  # tree widths measured and offered to the policy


class MedusaProposer(Proposer):
    needs_hidden = True

    def __init__(self, model_dir: str | Path, spec: ModelSpec, weight_dtype: str, num_heads: int | None = None,
                 fixed_width: int | None = None):
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
        self.accepted_counts = np.zeros((MAX_WIDTH, K + 1), np.int64)  # [w - 1, l], see the module docstring
        self.tree_sizes = np.array([[tree_size(w, d) for d in range(K + 1)] for w in range(1, MAX_WIDTH + 1)])
        self._pending: dict[str, list[tuple[int, np.ndarray]]] = {}  # request id -> (its tokens, ranked [K, W])

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        # the last feature (position first + n - 1) produced token first + n: the request then had first + n + 1
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
        ranked = _top(self.heads.logits(hidden), MAX_WIDTH)  # [K, R, MAX_WIDTH], best first
        for r, i in enumerate(rows):
            req = requests[i]
            self._pending.setdefault(req.request_id, []).append((len(req.token_ids), ranked[:, r]))
            depth = min(depths[i], self.heads.num_heads)
            best = ranked[:depth, r, :self.width]
            drafts[i] = best[:, 0].tolist() if self.width == 1 else _tree(best)
        return drafts

    def _measure(self, req: SpecRequest) -> None:
        """Count, for each proposal of req whose continuation is known now, the drafts each width's tree
        would have had accepted (head k guessed the token k + 1 places after the proposal's next one)."""
        pending = self._pending.get(req.request_id)
        if not pending:
            return
        K, tokens = self.heads.num_heads, req.token_ids
        while pending and pending[0][0] + 1 + K <= len(tokens):
            n, ranked = pending.pop(0)
            truth = tokens[n + 1:n + 1 + K]
            for w in range(1, MAX_WIDTH + 1):
                accepted = 0
                for k in range(K):
                    if truth[k] not in ranked[k, :w if k < 2 else 1]:
                        break
                    accepted += 1
                self.accepted_counts[w - 1, accepted] += 1


def tree_size(width: int, depth: int) -> int:
    """Nodes of _tree's tree of this width and depth."""
    return 0 if depth == 0 else width if depth == 1 else width + width * width * (depth - 1)


def _top(logits: np.ndarray, width: int) -> np.ndarray:
    """[K, R, V] -> the ids of the `width` largest per row, best first (ties: the lower id): [K, R, width]."""
    part = np.argpartition(-logits, width - 1, axis=2)[:, :, :width]
    values = np.take_along_axis(logits, part, axis=2)
    order = np.lexsort((part, -values), axis=2)
    return np.take_along_axis(part, order, axis=2)


def _tree(best: np.ndarray) -> TokenTree:
    """best [depth, width]: each head's guesses, best first -> every pair of the first two heads' guesses,
    each followed by the later heads' best guesses."""
    tokens, parents = [], []
    for first in best[0]:
        tokens.append(int(first))
        parents.append(-1)
        top = len(tokens) - 1
        for second in best[1] if len(best) > 1 else ():
            tokens.append(int(second))
            parents.append(top)
            for later in best[2:, 0]:
                tokens.append(int(later))
                parents.append(len(tokens) - 2)
    return TokenTree(tuple(tokens), tuple(parents))
