"""Proposer: what the engine asks of every draft method (n-gram lookup, a draft model, later trained heads).

Per step the engine passes the speculating requests and a depth for each; a proposer returns up to that
many draft tokens per request (fewer, or none, when it has no good guess). Drafts are verified in the
target's forward and the verified tokens come back through the request's `token_ids` on the next call, so
a proposer never needs to be told what was accepted: it compares and rolls back its own state itself.

`last_draft_probs[request_id]`: [len(drafts), vocab] float64 rows q_i the drafts of the last `propose`
call were sampled from; a request absent from it had deterministic drafts (q one-hot), which the verifier
takes as `draft_probs=None`.

What the speculation policy needs to price a proposer (scheduling/spec_policy.py):
- `last_passes`: (tokens, seconds) of each pass over the model the last call ran (a draft model: one
  forward per draft position); empty for a proposer that is one lookup, which the caller times itself.
- `cost_prior`: a pass's cost before any was timed, as fractions of the target step's fixed cost and of
  its per-token cost.
- `catches_up`: a request that has not drafted for a while costs a pass over every token it missed.
"""

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

import numpy as np

DRAFT_STREAM = 2  # the stream of keyed uniforms (kernels/sampling.py) drafts are drawn from; the target's
#                   sampler and verifier use 0 and 1 (scheduling/sampler.py)


class SpecRequest(Protocol):
    request_id: str
    token_ids: list[int]  # prompt + verified output
    # optional: `params` (a SamplingParams) and `seed` (int in [0, 2**64)); a draft model samples its drafts for
    # non-greedy requests, the draft at position p from the uniform keyed by (seed, p, DRAFT_STREAM)


class Proposer(ABC):
    cost_prior: tuple[float, float] = (0.0, 0.0)
    catches_up: bool = False

    def __init__(self) -> None:
        self.last_draft_probs: dict[str, np.ndarray] = {}
        self.last_passes: list[tuple[int, float]] = []

    @abstractmethod
    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        """Drafts per request, each of length <= its depth; [] where the depth is 0 or nothing is found."""

    def free(self, request_id: str) -> None:
        """Forget a finished or aborted request (a preempted one may stay: the next call catches up)."""
