"""ReplayProposer: drafts the target's own greedy continuation with a chosen share of tokens corrupted.

The speed-vs-acceptance sweep needs drafts whose acceptance it controls. The target's greedy continuation
of each prompt is computed once without speculation; a draft at output position j is that continuation's
token j, replaced by a different token with probability 1 - accept_rates[i] (i: the draft's position in
this proposal). With greedy verification a draft is accepted iff it is the continuation's token, so the
conditional acceptance at draft position i is accept_rates[i] and what the engine measures is what was
asked for. Proposing costs microseconds, so the sweep times verification alone.
"""

from collections.abc import Sequence

import numpy as np

from models.proposers.base import Proposer, SpecRequest


class ReplayProposer(Proposer):
    def __init__(self, continuations: dict[tuple[int, ...], list[int]], accept_rates: float | Sequence[float],
                 vocab_size: int, seed: int = 0):
        """continuations: prompt token ids -> the target's greedy output for that prompt (long enough for
        every draft); accept_rates: one rate for every position, or one per draft position."""
        super().__init__()
        self.continuations = continuations
        self.accept_rates = accept_rates
        self.vocab_size = vocab_size
        self.rng = np.random.default_rng(seed)
        self.num_proposed = 0

    def rate(self, i: int) -> float:
        if isinstance(self.accept_rates, (int, float)):
            return float(self.accept_rates)
        return float(self.accept_rates[min(i, len(self.accept_rates) - 1)])

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, depth in zip(requests, depths):
            continuation, num_prompt = self._continuation(req.token_ids)
            if continuation is None:
                drafts.append([])
                continue
            done = len(req.token_ids) - num_prompt
            truth = continuation[done:done + depth] if depth > 0 else []
            corrupt = self.rng.random(len(truth)) >= np.array([self.rate(i) for i in range(len(truth))])
            # a corrupted draft is any token but the true one: the target's argmax rejects it
            shift = self.rng.integers(1, self.vocab_size, len(truth))
            noise = (np.asarray(truth, np.int64) + shift) % self.vocab_size
            drafts.append([int(n) if c else int(t) for t, n, c in zip(truth, noise, corrupt)])
            self.num_proposed += len(truth)
        return drafts

    @property
    def prompt_lens(self) -> list[int]:
        return sorted({len(p) for p in self.continuations})

    def _continuation(self, token_ids: list[int]) -> tuple[list[int] | None, int]:
        """The continuation of the request's prompt; None (no drafts) for a prompt it was not given."""
        for n in self.prompt_lens:
            found = self.continuations.get(tuple(token_ids[:n]))
            if found is not None:
                return found, n
        return None, 0
