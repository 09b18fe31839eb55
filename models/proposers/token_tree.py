"""TokenTree: draft tokens as a tree under a request's last verified token, and what a verification keeps.

Nodes are listed parents first; node i's parent is parents[i] (-1: the last verified token, the root).
Verified in one forward, row 0 is the root and row 1 + i is node i; node i sits at position
root + depths[i] (its KV slot is its index, after the root's), sees the context and its ancestors (mask),
and the target's sample at each row is what it would draw after that row's path. A verification walks
from the root: the sample at the current row is appended; if a child of that row carries the same token,
the walk moves there, else it stops. A chain is the tree whose node i has parent i - 1.

A drafter that ranks its guesses gives each node its rank among its siblings (`ranks`, 0: the parent's
best guess). The width-w tree is then the nodes whose path has only ranks < w (`narrowed`); trees of
growing width nest, so one tree tells what each narrower one would have kept (`kept_by_width`).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class TokenTree:
    tokens: tuple[int, ...]  # [N] draft tokens
    parents: tuple[int, ...]  # [N] parent node of each (-1: the root), < its own index
    ranks: tuple[int, ...] | None = None  # [N] rank among its siblings (0: the best guess); None: unranked

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.parents)} parents")
        if self.ranks is not None and len(self.ranks) != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} tokens but {len(self.ranks)} ranks")
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
        return self._subtree([d <= max_depth for d in self.depths])

    def narrowed(self, width: int) -> "TokenTree":
        """The nodes whose path from the root has only ranks < width, in their order (a ranked tree)."""
        keep: list[bool] = []
        for p, rank in zip(self.parents, self.ranks):
            keep.append(rank < width and (p < 0 or keep[p]))
        return self._subtree(keep)

    def kept_by_width(self, truth, max_width: int) -> list[int]:
        """truth: the tokens that followed the root -> [max_width] the drafts the width-w tree (narrowed)
        keeps, w = 1 .. max_width: the walk follows truth as far as the tree holds it."""
        children: dict[int, dict[int, int]] = {}
        for i, (token, p) in enumerate(zip(self.tokens, self.parents)):
            children.setdefault(p, {}).setdefault(token, i)
        path_ranks, node = [], -1
        for token in truth:
            node = children.get(node, {}).get(int(token))
            if node is None:
                break
            path_ranks.append(self.ranks[node])
        kept = []
        for width in range(1, max_width + 1):
            n = 0
            while n < len(path_ranks) and path_ranks[n] < width:
                n += 1
            kept.append(n)
        return kept

    def _subtree(self, keep: list[bool]) -> "TokenTree":
        """The nodes marked in keep (each with its parent marked too), in their order."""
        nodes = [i for i, k in enumerate(keep) if k]
        index = {old: new for new, old in enumerate(nodes)} | {-1: -1}
        ranks = None if self.ranks is None else tuple(self.ranks[i] for i in nodes)
        return TokenTree(tuple(self.tokens[i] for i in nodes), tuple(index[self.parents[i]] for i in nodes),
                         ranks)

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
