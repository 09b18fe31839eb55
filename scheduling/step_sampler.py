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


def sample_step(plan: StepPlan, logits: np.ndarray, logit_rows: list[slice | None],
                draft_probs: dict[str, np.ndarray]) -> StepResult:
    """draft_probs: request id -> q [k, V] for drafts sampled from q (absent: deterministic drafts)."""
    row_ids, row_reqs, positions = [], [], []  # the rows the row sampler samples
    todo = []  # (request, drafts, its logits rows, its first row in row_ids or None)
    result = StepResult()
    for (req, _), rows in zip(plan.scheduled, logit_rows):
        if rows is None:
            continue
        if req.prompt_logits:
            result.prompt_logits[req.request_id] = logits[rows]
            continue
        drafts = plan.draft_token_ids.get(req.request_id, [])
        if drafts and not req.params.greedy and req.request_id in draft_probs:
            todo.append((req, drafts, rows, None))
            continue
        todo.append((req, drafts, rows, len(row_ids)))
        for i in range(len(drafts) + 1):
            row_ids.append(rows.start + i)
            row_reqs.append(RowContext(req, drafts[:i]) if i else req)
            positions.append(req.num_tokens + i)
    sampled = sample_rows(logits[row_ids], row_reqs, positions) if row_ids else []
    for req, drafts, rows, first in todo:
        if first is not None:
            tokens = accept_greedy(np.asarray(sampled[first:first + len(drafts) + 1]), drafts)
        else:
            tokens = _verify_sampled(req, drafts, logits[rows], draft_probs[req.request_id])
        k = req.params.logprobs
        logprobs = None if k is None else [top_logprobs(logits[rows.start + i], t, k) for i, t in enumerate(tokens)]
        result.add(req.request_id, tokens, logprobs, len(drafts), len(tokens) - 1)
    return result


def _verify_sampled(req: Request, drafts: list[int], logits: np.ndarray, q: np.ndarray) -> list[int]:
    # logits: [k + 1, V] raw target rows; q: [k, V] the draft distributions the drafts were drawn from
    p = req.params
    target = np.stack([sampling_probs(apply_penalties(x, ctx.token_ids[:req.num_prompt_tokens],
                                                      ctx.output_token_ids, p), p)
                       for i, x in enumerate(logits) for ctx in [RowContext(req, drafts[:i])]])
    uniforms = keyed_uniforms(req.seed, req.num_tokens, len(drafts) + 1)
    return verify_sampled(target, drafts, q[:len(drafts)], uniforms)
