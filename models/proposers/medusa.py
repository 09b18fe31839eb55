"""MedusaProposer: drafts from trained Medusa heads (models/medusa.py) over the target's hidden states.

The engine hands over, after each step, the hidden state of the row that produced each request's last
token (Proposer.observe_hidden); head k's argmax at that row is the draft k + 1 places after that token
(the target's own LM head gave the token itself). A request whose last token came from elsewhere (a
resumed or preempted request before its next forward) has no hidden state for it and drafts nothing that
step. With width > 1 it drafts a token tree: the top-`width` guesses of the first two heads (every pair)
and each later head's best guess under each pair, verified in one forward with tree attention.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from models.medusa import MedusaHeads, load_medusa_heads
from models.proposers.base import Proposer, SpecRequest
from models.spec import ModelSpec
from models.token_tree import TokenTree


class MedusaProposer(Proposer):
    needs_hidden = True

    def __init__(self, model_dir: str | Path, spec: ModelSpec, weight_dtype: str, num_heads: int | None = None,
                 width: int = 1):
        super().__init__()
        self.width = width
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

    def observe_hidden(self, request_id: str, num_tokens: int, hidden: np.ndarray) -> None:
        self._hidden[request_id] = (num_tokens, hidden)

    def free(self, request_id: str) -> None:
        self._hidden.pop(request_id, None)

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list:
        drafts: list = [[] for _ in requests]
        rows = [i for i, (req, depth) in enumerate(zip(requests, depths))
                if depth > 0 and self._hidden.get(req.request_id, (-1,))[0] == len(req.token_ids)]
        if not rows:
            return drafts
        hidden = np.stack([self._hidden[requests[i].request_id][1] for i in rows])  # [R, H]
        logits = self.heads.logits(hidden)  # [K, R, V]
        best = np.argsort(-logits, axis=2, kind="stable")[:, :, :self.width]  # [K, R, width], best first
        for r, i in enumerate(rows):
            depth = min(depths[i], self.heads.num_heads)
            drafts[i] = best[:depth, r, 0].tolist() if self.width == 1 else _tree(best[:depth, r])
        return drafts


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
