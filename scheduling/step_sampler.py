"""One step's sampling: every logits row of the step -> a StepResult with a list of tokens per request.

A request without drafts samples its one row. A speculating request has k + 1 rows (after its last
verified token and after each draft); row i is sampled as if drafts 0..i-1 were already its output
(penalties see them) at position num_tokens + i:
- drafts that are a deterministic guess (n-gram lookup, greedy drafting; q one-hot) and greedy
  requests: every row is sampled by the one row sampler and the run is the longest prefix of drafts
  equal to those samples, then the sample at the first mismatch (or the bonus). For q one-hot this is
  the rejection rule (accept d with probability p(d); on rejection a draw from p without d) realized
  with the same keyed draw as plain decoding, so a seeded request appends exactly the tokens it would
  without speculation.
- drafts sampled from a draft distribution q (a draft model on a sampled request): the rejection rule
  of scheduling/rejection.py on the request's sampling distributions, uniforms keyed by (seed, position).
"""

from collections.abc import Sequence

import numpy as np

from scheduling.batcher import StepPlan
from scheduling.outputs import StepResult
from scheduling.rejection import accept_greedy, verify_sampled
from scheduling.request import Request
from scheduling.sampler import apply_penalties, sample, sampling_probs, top_logprobs

_VERIFY_STREAM = 0x5EC1  # keys the rejection rule's uniforms apart from the row sampler's draw at a position


class RowContext:
    """A speculating request as its logits row i sees it: drafts 0..i-1 appended to its tokens."""

    def __init__(self, req: Request, drafts: Sequence[int]):
        self.req = req
        self.token_ids = req.token_ids + list(drafts)

    def __getattr__(self, name):  # params, seed, num_prompt_tokens, ...: the request's
        return getattr(self.req, name)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.req.num_prompt_tokens:]


def sample_rows(logits: np.ndarray, requests: Sequence, positions: Sequence[int]) -> list[int]:
    """The token of each row: logits [N, V] f32, the request (or RowContext) and the position each row
    samples. Randomness is keyed by (seed, position). The one place the step calls a sampler."""
    out = []
    for x, req, position in zip(logits, requests, positions):
        p = req.params
        if p.greedy and p.repetition_penalty == 1.0 and not (p.presence_penalty or p.frequency_penalty):
            out.append(int(np.argmax(x)))
            continue
        x = apply_penalties(x, req.token_ids[:req.num_prompt_tokens], req.output_token_ids, p)
        out.append(sample(x, p, np.random.default_rng((req.seed, position))))
    return out


def keyed_uniforms(seed: int, position: int, num_rows: int) -> np.ndarray:
    """[num_rows, 2] uniforms in [0, 1) for a verification whose first token sits at position, apart from
    the row sampler's draws. A request's verifications start at strictly increasing positions, so no
    key is drawn twice."""
    return np.random.default_rng((seed, position, _VERIFY_STREAM)).random((num_rows, 2))


def target_probs(logits: np.ndarray, requests: Sequence) -> np.ndarray:
    """[N, V] float64: the distribution each row's request samples from (penalties, temperature, top-k,
    top-p, min-p), for the rejection rule. The one place the step asks for sampling distributions."""
    return np.stack([sampling_probs(apply_penalties(x, r.token_ids[:r.num_prompt_tokens], r.output_token_ids,
                                                    r.params), r.params) for x, r in zip(logits, requests)])


def sample_step(plan: StepPlan, logits: np.ndarray, logit_rows: list[slice | None],
                draft_probs: dict[str, np.ndarray]) -> StepResult:
    """draft_probs: request id -> q [k, V] for drafts sampled from q (absent: deterministic drafts)."""
    sampled_rows = _Rows()  # rows the row sampler samples
    verified_rows = _Rows(by_rule=True)  # rows of requests whose drafts were sampled from q: the rejection rule
    todo = []  # (request, drafts, its logits rows, its first row in sampled_rows or in verified_rows)
    result = StepResult()
    for (req, _), rows in zip(plan.scheduled, logit_rows):
        if rows is None:
            continue
        if req.prompt_logits:
            result.prompt_logits[req.request_id] = logits[rows]
            continue
        drafts = plan.draft_token_ids.get(req.request_id, [])
        by_rule = bool(drafts) and not req.params.greedy and req.request_id in draft_probs
        todo.append((req, drafts, rows, (verified_rows if by_rule else sampled_rows).add(req, drafts, rows)))
    sampled = sample_rows(logits[sampled_rows.ids], sampled_rows.reqs, sampled_rows.positions) \
        if sampled_rows.ids else []
    probs = target_probs(logits[verified_rows.ids], verified_rows.reqs) if verified_rows.ids else None
    for req, drafts, rows, (by_rule, first) in todo:
        k = len(drafts)
        if by_rule:
            uniforms = keyed_uniforms(req.seed, req.num_tokens, k + 1)
            tokens = verify_sampled(probs[first:first + k + 1], drafts, draft_probs[req.request_id][:k], uniforms)
        else:
            tokens = accept_greedy(np.asarray(sampled[first:first + k + 1]), drafts)
        n = req.params.logprobs
        logprobs = None if n is None else [top_logprobs(logits[rows.start + i], t, n) for i, t in enumerate(tokens)]
        result.add(req.request_id, tokens, logprobs, k, len(tokens) - 1)
    return result


class _Rows:
    """Logits rows gathered for one batched call: row i of a request with drafts sees drafts[:i]."""

    def __init__(self, by_rule: bool = False):
        self.by_rule = by_rule
        self.ids: list[int] = []
        self.reqs: list = []
        self.positions: list[int] = []

    def add(self, req: Request, drafts: list[int], rows: slice) -> tuple[bool, int]:
        first = len(self.ids)
        for i in range(len(drafts) + 1):
            self.ids.append(rows.start + i)
            self.reqs.append(RowContext(req, drafts[:i]) if i else req)
            self.positions.append(req.num_tokens + i)
        return self.by_rule, first
