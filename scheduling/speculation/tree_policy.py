"""Tree width: per step, the draft tree width that maximizes expected goodput (like choose_depths for depth).

A proposer that ranks its guesses (Medusa, EAGLE) measures, for every proposal whose continuation is known,
how many drafts a tree of each width would have had accepted (`accepted_counts[w - 1, l]`: proposals whose
width-w tree keeps l drafts) and says how many nodes such a tree has (`tree_sizes[w - 1, d]` at depth d).
Those counts are exact, not modelled: the tokens a verification keeps are the target's own draws, the
same whatever was drafted (scheduling/sampling/step_sampler.py). A request drafting to depth d under width w
then appends 1 + E[min(l, d)] tokens and costs the step wide_per_token_s * (nodes - d) more than its chain,
charged draft_cost_factor times as a chain's drafts are: the slope over all recent steps, not the local one
the depths are priced with (flat where a few rows ride on the weights' memory stream, so 30 more rows would
look free: on the TinyLlama shape the policy tried width-3 trees that cost 3.5x a row-step). Width 1 (the
chain) until every width has MIN_MEASURED proposals (Medusa measures every width each proposal; EAGLE the
widths up to the one it drafted).
"""

from collections.abc import Sequence

import numpy as np

from models.proposers.tree_shape import MIN_MEASURED
from scheduling.speculation.depth_policy import SpeculationPolicy


def choose_tree_width(policy: SpeculationPolicy, accepted_counts: np.ndarray, tree_sizes: np.ndarray,
                      depths: Sequence[int], num_base_tokens: int) -> int:
    """accepted_counts, tree_sizes: [W, K + 1] (see the module docstring); depths: the step's per request."""
    max_depth = accepted_counts.shape[1] - 1  # a proposer drafts no deeper than it measures
    depths = np.minimum(np.asarray([d for d in depths if d > 0], np.int64), max_depth)
    measured = accepted_counts.sum(axis=1)  # [W] proposals measured per width
    if len(depths) == 0 or measured.min() < MIN_MEASURED:
        return 1
    lengths = np.arange(accepted_counts.shape[1])  # [K + 1]
    expected = (np.stack([accepted_counts @ np.minimum(lengths, d) for d in depths], axis=1)
                / measured[:, None])
    extra_nodes = (tree_sizes[:, depths] - depths).sum(axis=1)  # [W]: nodes beyond the chains' drafts
    base_s = max(policy.fixed_s + policy.per_token_s * (num_base_tokens + depths.sum()), 1e-12)
    node_s = policy.per_token_s if policy.wide_per_token_s is None else policy.wide_per_token_s
    goodput = ((len(depths) + expected.sum(axis=1))
               / (base_s + policy.draft_cost_factor * node_s * extra_nodes))
    return int(np.argmax(goodput)) + 1  # the first best: ties go to the narrower tree
