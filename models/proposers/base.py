"""Proposer: what the engine asks of every draft method (n-gram lookup, a draft model, later trained heads).

Per step the engine passes the speculating requests and a depth for each; a proposer returns up to that
many draft tokens per request (fewer, or none, when it has no good guess). Drafts are verified in the
target's forward and the verified tokens come back through the request's `token_ids` on the next call, so
a proposer never needs to be told what was accepted: it compares and rolls back its own state itself.

A draft is a guess of the target's own next token (greedy: its argmax; sampled: its keyed draw), checked
against the target's sample of the same row; a proposer's randomness, if any, never reaches the output.

What the speculation policy needs to price a proposer (scheduling/speculation/depth_policy.py):
- `last_passes`: (tokens, seconds) of each pass over the model the last call ran (a draft model: one
  forward per draft position); empty for a proposer that is one lookup, which the caller times itself.
- `cost_prior`: a pass's cost before any was timed, as fractions of the target step's fixed cost and of
  its per-token cost.
- `catches_up`: a request that has not drafted for a while costs a pass over every token it missed.

A proposer that drafts from the target's hidden states (trained heads) sets `needs_hidden`: after each
step the engine hands it, per request, the final-norm hidden states of the positions the step verified
(`observe_hidden`), from the step's own forward; the last of them produced the request's last token.

A proposer that can draft token trees measures what each width would have kept (`accepted_counts`,
`tree_sizes`: scheduling/speculation/tree_policy.py) and drafts at the `width` the speculator sets each step
(or at its `fixed_width`).
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np


class SpecRequest(Protocol):
    request_id: str
    token_ids: list[int]  # prompt + verified output
    # optional: `params` (a SamplingParams), `seed` (int in [0, 2**64)) and `num_prompt_tokens`: a draft model
    # samples a non-greedy request's drafts as the request samples, keyed like the target's draws


class Proposer(ABC):
    cost_prior: tuple[float, float] = (0.0, 0.0)
    catches_up: bool = False
    needs_hidden: bool = False
    accepted_counts: np.ndarray | None = None  # [max width, max depth + 1] (tree drafters only)
    tree_sizes: np.ndarray | None = None  # [max width, max depth + 1]
    width: int = 1
    fixed_width: int | None = None

    def __init__(self) -> None:
        self.last_passes: list[tuple[int, float]] = []

    @abstractmethod
    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list:
        """Drafts per request: a list of tokens (a chain, of length <= its depth) or a TokenTree (no deeper
        than its depth; verified with tree attention); [] where the depth is 0 or nothing is found."""

    def free(self, request_id: str) -> None:
        """Forget a finished or aborted request (a preempted one may stay: the next call catches up)."""

    def observe_hidden(self, request_id: str, first: int, features: np.ndarray) -> None:
        """features [n, H] f32: the target's final-norm hidden states f_p at the request's positions
        p = first .. first + n - 1 (f_p is the row that produced token p + 1); only when needs_hidden."""
