"""The tree-width policy (scheduling/speculation/tree_policy.py) on measured counts, and the Medusa proposer's
measurement of what each width would have kept (exact against hand-computed walks)."""

import numpy as np
import pytest

import numaserve as ns
from models.proposers.medusa import MedusaProposer
from models.proposers.tree_shape import MAX_WIDTH, tree_size, tree_sizes
from scheduling.speculation.depth_policy import SpecTelemetry, SpeculationPolicy, speculation_policy
from scheduling.speculation.tree_policy import MIN_MEASURED, choose_tree_width

K = 3


def policy(fixed_s: float, per_token_s: float, wide_per_token_s: float | None = None) -> SpeculationPolicy:
    return SpeculationPolicy("on", K, (0.5,) * K, fixed_s, per_token_s, 0.0, 1.0, 1.0,
                             wide_per_token_s=wide_per_token_s)


def counts(mean_kept_by_width: list[list[int]]) -> np.ndarray:
    """[W, K + 1] counts from per-width lists of drafts kept per proposal."""
    out = np.zeros((MAX_WIDTH, K + 1), np.int64)
    for w, kept in enumerate(mean_kept_by_width):
        for k in kept:
            out[w, k] += 1
    return out


SIZES = tree_sizes(K)


def test_tree_sizes_match_the_trees_the_proposer_builds():
    from models.proposers.medusa import _tree
    for w in range(1, MAX_WIDTH + 1):
        for d in range(1, K + 1):
            assert len(_tree(np.arange(d * w).reshape(d, w)).tokens) == tree_size(w, d)


def test_a_wider_tree_is_chosen_when_it_keeps_more_and_tokens_are_cheap():
    n = MIN_MEASURED
    kept = counts([[1] * n, [2] * n, [2] * n, [2] * n])  # width 1 keeps one draft, 2 (and wider) two
    assert choose_tree_width(policy(0.010, 0.00001), kept, SIZES, [K] * 4, 4) == 2  # ties go narrower
    # a token costing ten fixed costs: 7 more nodes per request for one more token do not pay
    assert choose_tree_width(policy(0.001, 0.010), kept, SIZES, [K] * 4, 4) == 1


def test_tree_nodes_are_priced_at_the_slope_of_all_steps_not_the_flat_local_one():
    # the depths' local fit is flat (a few rows ride on the weights' stream) but steps as large as the trees
    # cost a tenth of the fixed cost per token: 7 more nodes per request for one more token do not pay
    kept = counts([[1] * MIN_MEASURED, [2] * MIN_MEASURED, [2] * MIN_MEASURED, [2] * MIN_MEASURED])
    assert choose_tree_width(policy(0.010, 0.00001, 0.00001), kept, SIZES, [K] * 4, 4) == 2
    assert choose_tree_width(policy(0.010, 0.00001, 0.001), kept, SIZES, [K] * 4, 4) == 1


def test_the_wide_slope_is_fitted_over_every_step_and_never_below_the_local_one():
    config = ns.SpeculationConfig(method="medusa", num_speculative_tokens=K, mode="on")
    flat_then_steep = tuple((n, 0.010) for n in (1, 2, 3, 4) * 4) + tuple((n, 0.010 + 0.001 * (n - 4))
                                                                         for n in (16, 32, 64))
    p = speculation_policy(SpecTelemetry(config, (0.5,) * K, flat_then_steep, num_requests=1))
    assert p.per_token_s == pytest.approx(0.0, abs=1e-9)  # the depths' fit: steps up to 2 x (1 + K) tokens
    assert p.wide_per_token_s > 0.0005
    line = tuple((n, 0.01 + 0.0001 * n) for n in (1, 2, 3, 4) * 4)
    p = speculation_policy(SpecTelemetry(config, (0.5,) * K, line, num_requests=1))
    assert p.wide_per_token_s == pytest.approx(p.per_token_s)


def test_the_chain_until_enough_proposals_are_measured_and_without_drafts():
    kept = counts([[0] * (MIN_MEASURED - 1), [3] * (MIN_MEASURED - 1)] + [[3] * (MIN_MEASURED - 1)] * 2)
    assert choose_tree_width(policy(0.010, 0.00001), kept, SIZES, [K] * 4, 4) == 1
    full = counts([[0] * MIN_MEASURED, [3] * MIN_MEASURED] + [[3] * MIN_MEASURED] * 2)
    assert choose_tree_width(policy(0.010, 0.00001), full, SIZES, [0, 0], 2) == 1


class FakeHeads:
    """Heads whose logits rank token ids in a set order per head: ranking[k] best first."""

    def __init__(self, ranking: list[list[int]], vocab: int = 16):
        self.num_heads = len(ranking)
        self.logits_row = np.zeros((len(ranking), vocab), np.float32)
        for k, ids in enumerate(ranking):
            self.logits_row[k, ids] = np.arange(len(ids), 0, -1)

    def logits(self, hidden):
        return np.repeat(self.logits_row[:, None], len(hidden), axis=1)


class Req:
    def __init__(self, token_ids):
        self.request_id, self.token_ids = "r", token_ids


@pytest.mark.parametrize("truth, kept", [
    ([1, 5, 7], [3, 3, 3, 3]),  # every head's best guess was right: every width keeps all 3
    ([2, 5, 7], [0, 3, 3, 3]),  # head 0's second guess: width 1 keeps none, 2+ keep all
    ([1, 8, 7], [1, 1, 1, 3]),  # head 1's fourth guess: only width 4 keeps it and head 2's best after it
    ([4, 6, 3], [0, 0, 0, 2]),  # head 0's fourth, head 1's second, head 2 missed
])
def test_the_proposer_counts_what_each_width_would_have_kept(truth, kept):
    proposer = MedusaProposer.__new__(MedusaProposer)
    proposer.heads = FakeHeads([[1, 2, 3, 4], [5, 6, 7, 8], [7, 0, 2, 3]])
    proposer.width, proposer.fixed_width = 1, None
    proposer._hidden, proposer._pending = {}, {}
    proposer.accepted_counts = np.zeros((MAX_WIDTH, K + 1), np.int64)
    req = Req([3, 3, 3])
    proposer.observe_hidden("r", 1, np.zeros((1, 4), np.float32))  # f_1 produced token 2: the request has 3
    assert proposer.propose([req], [K]) == [[1, 5, 7]]  # the chain: each head's best
    req.token_ids = [3, 3, 3] + truth  # the tokens heads 0, 1, 2 guessed at (head 0: the next one)
    proposer.propose([req], [0])
    got = [int(np.flatnonzero(row)[0]) for row in proposer.accepted_counts]
    assert got == kept and proposer.accepted_counts.sum() == MAX_WIDTH
