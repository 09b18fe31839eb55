"""TokenTree: draft tokens as a tree under a request's last verified token, and what a verification keeps.

Nodes are listed parents first; node i's parent is parents[i] (-1: the last verified token, the root).
Verified in one forward, row 0 is the root and row 1 + i is node i; node i sits at position
root + depths[i] (its KV slot is its index, after the root's), sees the context and its ancestors (mask),
and the target's sample at each row is what it would draw after that row's path. A verification walks
from the root: the sample at the current row is appended; if a child of that row carries the same token,
the walk moves there, else it stops. A chain is the tree whose node i has parent i - 1.
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # [N] draft tokens
    parents: tuple[int, ...]  # [N] parent node of each (-1: the root), < its own index

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i}'s parent {p} is not an earlier node or -1 (the root)")

    @classmethod
    def chain(cls, tokens) -> "TokenTree":
        return cls(tuple(int(t) for t in tokens), tuple(range(-1, len(tokens) - 1)))

    @property
    def is_chain(self) -> bool:
        return self.parents == tuple(range(-1, len(self.tokens) - 1))

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """[N] 1 for the root's children, 2 for theirs, ..."""
        depths: list[int] = []
        for p in self.parents:
            depths.append(1 if p < 0 else depths[p] + 1)
        return tuple(depths)

    def path(self, i: int) -> list[int]:
        """The nodes from the root's child down to node i (i included)."""
        nodes = []
        while i >= 0:
            nodes.append(i)
            i = self.parents[i]
        return nodes[::-1]

    def mask(self, width: int | None = None) -> np.ndarray:
        """[N, width] uint8: row i marks node i's ancestors and itself (the attention kernel's tree_mask)."""
        n = len(self.tokens)
        out = np.zeros((n, width or n), np.uint8)
        for i in range(n):
            out[i, self.path(i)] = 1
        return out

    def truncated(self, max_depth: int) -> "TokenTree":
        """The nodes at depth <= max_depth (their parents are kept with them), in their order."""
        keep = [i for i, d in enumerate(self.depths) if d <= max_depth]
        index = {old: new for new, old in enumerate(keep)} | {-1: -1}
        return TokenTree(tuple(self.tokens[i] for i in keep), tuple(index[self.parents[i]] for i in keep))

    def walk(self, samples) -> tuple[list[int], list[int]]:
        """samples: [N + 1] the target's sample at each row (row 0: the root) -> (the tokens the verification
        appends: accepted drafts then the target's own token, the rows they were sampled at)."""
        children: dict[int, dict[int, int]] = {}
        for i, (token, p) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault(p, {}).setdefault(token, i)  # the first of equal siblings
        tokens, rows, node = [], [], -1
        while True:
            row = node + 1
            token = int(samples[row])
            tokens.append(token)
            rows.append(row)
            node = children.get(node, {}).get(token)
            if node is None:
                return tokens, rows
