"""A modelled draft proposer and the modelled sampler that verifies it.

Each request's output is fixed by its trace (Arrival.output_ids). The proposer's guess of output position p
is right with probability accept_rate, decided once per (seed, request, p): a draft is the true tokens up to
the first wrong guess, which is replaced by a token that cannot match. `sample` is the verification: each
request appends its drafts' longest prefix equal to the true output, then one true token (as
scheduling/sampling/step_sampler.py appends the target's own draws), so a request's output does not depend on
drafting, as in the engine.
"""

from collections.abc import Sequence

import numpy as np

from models.proposers.base import Proposer
from scheduling.outputs import SampledTokens, SamplerOutput
from scheduling.plan import StepPlan
from scheduling.request import Request


class SimProposer(Proposer):
    """A lookup proposer (n-gram-like: no pass of its own over the model, cost_prior 0) of modelled
    acceptance; its pass costs draft_pass_s per drafting request (last_passes, in modelled seconds)."""

    def __init__(self, accept_rate: float, seed: int, draft_pass_s: float):
        super().__init__()
        self.accept_rate, self.seed, self.draft_pass_s = accept_rate, seed, draft_pass_s
        self.outputs: dict[str, tuple[int, ...]] = {}
        self.right: dict[str, np.ndarray] = {}  # per request: is the guess at each output position right

    def register(self, request_id: str, output_ids: Sequence[int], index: int) -> None:
        """A request's true output; index: its position in the trace (keys its guesses)."""
        self.outputs[request_id] = tuple(output_ids)
        rng = np.random.default_rng((self.seed, index))
        self.right[request_id] = rng.random(len(output_ids)) < self.accept_rate

    def propose(self, requests: Sequence[Request], depths: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, depth in zip(requests, depths):
            true, right = self.outputs[req.request_id], self.right[req.request_id]
            n = req.num_tokens - req.num_prompt_tokens
            draft = []
            for p in range(n, min(n + depth, len(true))):
                draft.append(true[p] if right[p] else -1)  # -1: no token id, never the true one
                if not right[p]:
                    break
            drafts.append(draft)
        self.last_passes = [(len(requests), self.draft_pass_s * len(requests))]
        return drafts


    def free(self, request_id: str) -> None:
        pass  # the outputs stay: a later session turn never shares a request id

    def sample(self, plan: StepPlan) -> SamplerOutput:
        """The step's tokens per scheduled request: None for a prefill chunk short of its prompt's end."""
        sampled = []
        for s in plan.scheduled:
            req = s.request
            if req.num_computed_tokens + s.num_base_tokens < req.num_tokens:
                sampled.append(None)
                continue
            drafts, n = s.draft_token_ids, req.num_tokens - req.num_prompt_tokens
            true = self.outputs[req.request_id][n:n + len(drafts) + 1]
            num_accepted = 0
            while num_accepted < len(drafts) and drafts[num_accepted] == true[num_accepted]:
                num_accepted += 1
            sampled.append(SampledTokens(list(true[:num_accepted + 1]), None, len(drafts), num_accepted,
                                         list(range(num_accepted + 1))))
        return SamplerOutput(tuple(sampled), (None,) * len(plan.scheduled), (None,) * len(plan.scheduled))
