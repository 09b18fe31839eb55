"""One step's sampling: every logits row of the step -> a StepResult with a list of tokens per request.

A request without drafts samples its one row. A speculating request has k + 1 rows (after its last
verified token and after each draft); row i is sampled as if drafts 0..i-1 were already its output
(penalties see them) at position num_tokens + i:
- drafts that are a deterministic guess (n-gram lookup, greedy drafting; q one-hot) and greedy
  requests: every row is sampled by sample_batch with the other rows of the step and the run is the
  longest prefix of drafts equal to those samples, then the sample at the first mismatch (or the bonus).
  For q one-hot this is the rejection rule (accept d with probability p(d); on rejection a draw from p
  without d) realized with the same keyed draw as plain decoding, so a seeded request appends exactly the
  tokens it would without speculation.
- drafts sampled from a draft distribution q (a draft model on a sampled request): the rejection rule
  of scheduling/rejection.py on the request's sampling distributions (sampling_probs_batch), with
  verify_uniforms keyed by (seed, position).
Logprobs of every appended token of the step come from one top_logprobs_batch call.
"""

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from scheduling.batcher import StepPlan
from scheduling.outputs import StepResult
from scheduling.rejection import accept_greedy, verify_sampled
from scheduling.request import Request
from scheduling.sampler import sample_batch, sampling_probs_batch, top_logprobs_batch, verify_uniforms


class RowContext:
    """A speculating request as its logits row i sees it: drafts 0..i-1 appended to its tokens."""

    def __init__(self, req: Request, drafts: Sequence[int]):
        self.req, self.drafts = req, drafts

    @cached_property
    def token_ids(self) -> list[int]:  # read only for penalties
        return self.req.token_ids + list(self.drafts)

    def __getattr__(self, name):  # params, seed, num_prompt_tokens, ...: the request's
        return getattr(self.req, name)


def sample_step(plan: StepPlan, logits: np.ndarray, logit_rows: list[slice | None],
                draft_probs: dict[str, np.ndarray]) -> StepResult:
    """logits: [R, V] f32, logit_rows: per scheduled request its rows (None: none); draft_probs: request
    id -> q [k, V] for drafts sampled from q (absent: deterministic drafts)."""
    sampled_rows = _Rows()  # rows sample_batch samples
    verified_rows = _Rows()  # rows of requests whose drafts were sampled from q: the rejection rule
    todo = []  # (request, drafts, its logits rows, by the rule, its first row in sampled_rows or verified_rows)
    result = StepResult()
    for (req, _), rows in zip(plan.scheduled, logit_rows):
        if rows is None:
            continue
        if req.prompt_logits:
            result.prompt_logits[req.request_id] = logits[rows]
            continue
        drafts = plan.draft_token_ids.get(req.request_id, [])
        by_rule = bool(drafts) and not req.params.greedy and req.request_id in draft_probs
        todo.append((req, drafts, rows, by_rule, (verified_rows if by_rule else sampled_rows).add(req, drafts, rows)))
    sampled = sample_batch(_gather(logits, sampled_rows.ids), sampled_rows.reqs, sampled_rows.positions)
    probs = sampling_probs_batch(logits[verified_rows.ids], verified_rows.reqs) if verified_rows.ids else None
    runs = []
    for req, drafts, rows, by_rule, first in todo:
        k = len(drafts)
        if by_rule:
            uniforms = verify_uniforms(req.seed, req.num_tokens, k + 1)
            runs.append(verify_sampled(probs[first:first + k + 1], drafts, draft_probs[req.request_id][:k], uniforms))
        else:
            runs.append(accept_greedy(sampled[first:first + k + 1], drafts))
    logprobs = _logprobs(logits, todo, runs)
    for (req, drafts, *_), tokens, lps in zip(todo, runs, logprobs):
        result.add(req.request_id, tokens, lps, len(drafts), len(tokens) - 1)
    return result


def _logprobs(logits: np.ndarray, todo: list, runs: list[list[int]]) -> list[list[dict[int, float]] | None]:
    """Per request: the logprobs of each token of its run (token i from its row i), None if not asked."""
    ids, tokens, counts = [], [], []
    for (req, _, rows, *_), run in zip(todo, runs):
        if req.params.logprobs is not None:
            ids += range(rows.start, rows.start + len(run))
            tokens += run
            counts += [req.params.logprobs] * len(run)
    rows = iter(top_logprobs_batch(logits[ids], tokens, counts) if ids else ())
    return [None if req.params.logprobs is None else [next(rows) for _ in run]
            for (req, *_), run in zip(todo, runs)]


def _gather(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """logits[ids], without a copy when ids are every row in order (a plain decode step)."""
    return logits if ids == list(range(len(logits))) else logits[ids]


class _Rows:
    """Logits rows gathered for one batched call: row i of a request with drafts sees drafts[:i]."""

    def __init__(self):
        self.ids: list[int] = []
        self.reqs: list = []
        self.positions: list[int] = []

    def add(self, req: Request, drafts: list[int], rows: slice) -> int:
        """-> the request's first row here."""
        first = len(self.ids)
        for i in range(len(drafts) + 1):
            self.ids.append(rows.start + i)
            self.reqs.append(RowContext(req, drafts[:i]) if i else req)
            self.positions.append(req.num_tokens + i)
        return first
