"""The token trees the trained-head proposers draft (Medusa, EAGLE), and how their widths are measured.

A tree of width w and depth d: the root's top-w guesses, each with its own top-w guesses (every pair of
the first BRANCHING_DEPTHS levels), then each of those followed by the best guess at every later level:
w + w * w * (d - 1) nodes. Each node carries its rank among its siblings (TokenTree.ranks), so trees of
growing width nest (TokenTree.narrowed) and one drafted tree tells, once the tokens that followed are
known, what every narrower tree would have kept (TokenTree.kept_by_width): the proposer's
`accepted_counts`, which scheduling/speculation/tree_policy.py turns into a width.
"""

import numpy as np

from cluster_configs.speculation_config import MAX_TREE_WIDTH as MAX_WIDTH  # widths measured and offered

# proposals measured before the policy leaves the chain (scheduling/speculation/tree_policy.py)
MIN_MEASURED = 16
BRANCHING_DEPTHS = 2  # levels whose nodes each get the top-w guesses; one guess per node after


def tree_size(width: int, depth: int) -> int:
    """Nodes of the width-`width` tree of this depth."""
    return 0 if depth == 0 else width if depth == 1 else width + width * width * (depth - 1)


def tree_sizes(max_depth: int) -> np.ndarray:
    """[MAX_WIDTH, max_depth + 1]: tree_size(w, d) at [w - 1, d] (a proposer's `tree_sizes`)."""
    return np.array([[tree_size(w, d) for d in range(max_depth + 1)] for w in range(1, MAX_WIDTH + 1)])


def branching(depth: int, width: int) -> int:
    """How many guesses a node at this depth (the root: 0) gets as children."""
    return width if depth < BRANCHING_DEPTHS else 1


def top_ids(logits: np.ndarray, width: int) -> np.ndarray:
    """[..., V] -> the ids of the `width` largest per row, best first (ties: the lower id): [..., width]."""
    part = np.argpartition(-logits, width - 1, axis=-1)[..., :width]
    values = np.take_along_axis(logits, part, axis=-1)
    order = np.lexsort((part, -values), axis=-1)
    return np.take_along_axis(part, order, axis=-1)
