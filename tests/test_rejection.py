"""Verification: greedy keeps the target's argmax run; rejection sampling emits exactly the target's distribution."""

import numpy as np
import pytest
import torch

from scheduling.rejection import accept_greedy, verify_greedy, verify_sampled

VOCAB = 16
NUM_RUNS = 20_000
K = 3
MIN_P_VALUE = 1e-3  # the chi-square tests below are seeded: each passes or fails deterministically


def onehot_rows(ids: list[int]) -> np.ndarray:
    logits = np.zeros((len(ids), VOCAB), np.float32)
    logits[np.arange(len(ids)), ids] = 5.0
    return logits


def test_greedy_accepts_every_matching_draft_plus_a_bonus():
    assert verify_greedy(onehot_rows([3, 4, 5, 6]), [3, 4, 5]) == [3, 4, 5, 6]


def test_greedy_stops_at_the_first_mismatch_with_the_targets_token():
    assert verify_greedy(onehot_rows([3, 9, 5, 6]), [3, 4, 5]) == [3, 9]
    assert verify_greedy(onehot_rows([7, 4, 5, 6]), [3, 4, 5]) == [7]


def test_greedy_without_drafts_is_one_plain_decode_step():
    assert verify_greedy(onehot_rows([11]), []) == [11]
    assert accept_greedy(np.array([2]), []) == [2]


def chi_square_p_value(observed: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of counts against probs; bins expected < 5 times are pooled, zero-probability bins
    must be empty."""
    assert observed[probs == 0].sum() == 0, "sampled a token the target gives probability 0"
    expected = probs * observed.sum()
    small = (expected < 5) & (probs > 0)
    obs = np.append(observed[expected >= 5], observed[small].sum())
    exp = np.append(expected[expected >= 5], expected[small].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(obs) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def filtered(p: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    p = p.copy()
    p[p < np.sort(p)[-top_k]] = 0.0
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    p[order[np.cumsum(p[order]) - p[order] >= top_p]] = 0.0
    return p / p.sum()


def run_verifications(p: np.ndarray, q: np.ndarray | None, onehot_drafts: list[int] | None, seed: int):
    """First emitted token of NUM_RUNS verifications, and how many runs rejected a draft."""
    rng = np.random.default_rng(seed)
    first = np.zeros(VOCAB, np.int64)
    num_rejected = 0
    for _ in range(NUM_RUNS):
        drafts = onehot_drafts if q is None else [int(rng.choice(VOCAB, p=q[i])) for i in range(K)]
        out = verify_sampled(p, drafts, q, rng)
        first[out[0]] += 1
        num_rejected += len(out) <= K
    return first, num_rejected


@pytest.fixture(scope="module")
def target():
    return np.random.default_rng(0).dirichlet(np.full(VOCAB, 2.0), size=K + 1)  # p: [K + 1, VOCAB]


@pytest.mark.parametrize("case", ["random_q", "onehot_q", "top_k_top_p_target"])
def test_rejection_sampling_emits_the_targets_distribution(target, case):
    p = target
    q = np.random.default_rng(1).dirichlet(np.full(VOCAB, 1.0), size=K)
    onehot_drafts = None
    if case == "onehot_q":
        q, onehot_drafts = None, [int(np.argmax(p[0])), 5, 9]
    if case == "top_k_top_p_target":
        p = np.stack([filtered(row, top_k=6, top_p=0.8) for row in p])
    first, num_rejected = run_verifications(p, q, onehot_drafts, seed=2)
    assert 0 < num_rejected < NUM_RUNS  # drafts were both accepted and rejected
    assert chi_square_p_value(first, p[0]) > MIN_P_VALUE


def test_chi_square_check_detects_the_draft_distribution(target):
    # power check of the test above: accepting every draft emits q, which the test must reject
    rng = np.random.default_rng(3)
    q = np.random.default_rng(1).dirichlet(np.full(VOCAB, 1.0))
    first = np.bincount(rng.choice(VOCAB, size=NUM_RUNS, p=q), minlength=VOCAB)
    assert chi_square_p_value(first, target[0]) < 1e-12


def test_uniform_draws_decide_the_outcome():
    p = np.full((3, VOCAB), 1.0 / VOCAB)
    drafts = [4, 7]
    accept_all = np.array([[0.0, 0.5], [0.0, 0.5], [0.0, 0.5]])
    assert verify_sampled(p, drafts, None, accept_all) == [4, 7, 8]  # bonus: inverse CDF at 0.5
    reject_first = np.array([[0.99, 0.0], [0.0, 0.5], [0.0, 0.5]])
    assert verify_sampled(p, drafts, None, reject_first) == [0]  # the residual excludes the rejected draft 4
    reject_token_0 = np.array([[0.99, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert verify_sampled(p, [0, 7], None, reject_token_0) == [1]
