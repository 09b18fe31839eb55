"""Pearson's chi-square test of sampled counts against probabilities, for the seeded distribution tests."""

import numpy as np
import torch


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
