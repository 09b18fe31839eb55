"""One step's sampling: every logits row of the step -> a SamplerOutput with a list of tokens per request.

A request without drafts samples its one row. A speculating request has k + 1 rows (after its last
verified token and after each draft); row i is sampled as if drafts 0..i-1 were already its output
(penalties see them) at position num_tokens + i, by sample_batch with the other rows of the step, and the
run is the longest prefix of drafts equal to those samples, then the sample at the first mismatch (or the
bonus). Every token appended is the one plain decoding would have drawn there (its keyed race), so
speculation changes no token of any request, greedy or seeded, whatever drafted it, how deep, or what
else was in the batch: the output distribution is the target's because the output is the target's own
draws. Drafts only decide how many of those draws one step makes. A draft model that races with the same
keyed clocks guesses a sampled request's draw with probability >= (1 - TV) / (1 + TV) of its and the
target's distributions; the standard rejection rule (accept with min(1, p / q)) would accept up to 1 - TV
of them, but its tokens depend on whether and how deep a request drafted, which the load-aware policy
decides from the batch (benchmarks/spec_coupling.py, the demo family's held-out windows: temperature 1,
0.55 accepted by the race against 0.61 by the rule; temperature 0.7, 0.52 against 0.56).
A request whose drafts form a tree (models/proposers/token_tree.py) has one row per node after its root row;
node i's row sees its path's tokens at position num_tokens + depth, and the run is the tree's walk.
Logprobs of every appended token of the step, and of the prompt tokens scored for prompt_logprobs, come from
one top_logprobs_batch call.
A constrained request (structured outputs) samples each row under its grammar's token mask after the
drafts before the row (its drafts are the ones its grammar admits: scheduling/speculation/speculator.py); its
logprobs are the model's, before the mask, as everyone's are before penalties (vLLM's default, raw_logprobs).
"""

from collections.abc import Sequence

import numpy as np

from cluster_configs.sampling_params import SamplingParams
from models.proposers.token_tree import TokenTree
from models.sampling_batch import SamplingBatch, sets_penalty
from scheduling.model_runner import RunOutput
from scheduling.outputs import SampledTokens, SamplerOutput
from scheduling.plan import StepPlan
from scheduling.request import Request
from scheduling.sampling.sampler import sample_batch, top_logprobs_batch


def sample_step(plan: StepPlan, run: RunOutput, masks: dict[int, np.ndarray] | None = None,
                eos_token_ids: Sequence[int] = ()) -> SamplerOutput:
    """masks: index in plan.scheduled -> [1 + num drafts, V] bool, the tokens a constrained request's rows
    may take. eos_token_ids: what min_tokens bans."""
    logits = run.logits  # [R, V] f32
    rows_to_sample = _Rows()
    # (index in plan.scheduled, request, its drafts' tree, its logits rows, its first row in rows_to_sample)
    todo = []
    collected: list[np.ndarray | None] = [None] * len(plan.scheduled)
    for i, (scheduled, rows) in enumerate(zip(plan.scheduled, run.logit_rows)):
        req = scheduled.request
        if req.pooling:
            collected[i] = run.hidden[run.first_rows[i]:run.first_rows[i] + scheduled.num_new_tokens]
            continue
        if rows is None:
            continue
        if req.prompt_logits:
            collected[i] = logits[rows]
            continue
        tree = scheduled.draft_tree
        todo.append((i, req, tree, rows, rows_to_sample.add(req, tree, rows)))
        if masks and i in masks:
            rows_to_sample.masks[todo[-1][-1]] = masks[i]
    sampled = sample_batch(_gather(logits, rows_to_sample.ids),
                           rows_to_sample.batch(logits.shape[1], eos_token_ids))
    runs = [tree.walk(sampled[first:first + len(tree.tokens) + 1]) for *_, tree, _, first in todo]
    logprobs, prompt_logprobs = _logprobs(logits, todo, runs, plan, run)
    out: list[SampledTokens | None] = [None] * len(plan.scheduled)
    for (i, _, tree, *_), (tokens, sampled_rows), lps in zip(todo, runs, logprobs):
        depth = max(tree.depths, default=0)  # the positions the drafts covered
        out[i] = SampledTokens(tokens, lps, depth, len(tokens) - 1, sampled_rows)
    return SamplerOutput(tuple(out), tuple(collected), tuple(prompt_logprobs))


LogprobRows = list[list[dict[int, float]] | None]


def _logprobs(logits: np.ndarray, todo: list, runs: list[tuple[list[int], list[int]]], plan: StepPlan,
              run_out: RunOutput) -> tuple[LogprobRows, LogprobRows]:
    """Per sampling request: the logprobs of each token of its run (from the row it was sampled at), None if
    not asked; per scheduled request: those of the prompt tokens its prompt rows score, None if none."""
    ids, tokens, counts = [], [], []
    scored = []  # (index in plan.scheduled, number of prompt rows)
    for i, (scheduled, rows, first) in enumerate(zip(plan.scheduled, run_out.prompt_rows,
                                                     run_out.prompt_starts)):
        if rows is not None:
            req = scheduled.request
            ids += range(rows.start, rows.stop)
            tokens += req.token_ids[first + 1:first + 1 + rows.stop - rows.start]
            counts += [req.params.prompt_logprobs] * (rows.stop - rows.start)
            scored.append((i, rows.stop - rows.start))
    for (_, req, _, rows, _), (run, sampled_rows) in zip(todo, runs):
        if req.params.logprobs is not None:
            ids += [rows.start + r for r in sampled_rows]
            tokens += run
            counts += [req.params.logprobs] * len(run)
    rows = iter(top_logprobs_batch(logits[ids], tokens, counts) if ids else ())
    prompt_logprobs: LogprobRows = [None] * len(plan.scheduled)
    for i, n in scored:
        prompt_logprobs[i] = [next(rows) for _ in range(n)]
    return [None if req.params.logprobs is None else [next(rows) for _ in run]
            for (_, req, *_), (run, _) in zip(todo, runs)], prompt_logprobs


def _gather(logits: np.ndarray, ids: list[int]) -> np.ndarray:
    """logits[ids], without a copy when ids are every row in order (a plain decode step)."""
    return logits if ids == list(range(len(logits))) else logits[ids]


class _Rows:
    """Logits rows gathered for one batched call: a request's row 1 + i (draft node i) is sampled as if the
    drafts of the path down to node i were its output (penalties see them) at position num_tokens + depth."""

    def __init__(self):
        self.ids: list[int] = []
        self.params: list[SamplingParams] = []
        self.seeds: list[int] = []
        self.positions: list[int] = []
        self.histories: list[Sequence[int]] = []
        self.num_prompt_tokens: list[int] = []
        self.masks: dict[int, np.ndarray] = {}  # first row here -> [n, V] bool, the mask of n rows from it

    def add(self, req: Request, tree: TokenTree, rows: slice) -> int:
        """-> the request's first row here."""
        first = len(self.ids)
        penalized = sets_penalty(req.params)
        self._add(req, rows.start, req.num_tokens, req.token_ids if penalized else ())
        for i, depth in enumerate(tree.depths):
            history = req.token_ids + [tree.tokens[j] for j in tree.path(i)] if penalized else ()
            self._add(req, rows.start + 1 + i, req.num_tokens + depth, history)
        return first

    def batch(self, vocab_size: int, eos_token_ids: Sequence[int]) -> SamplingBatch:
        token_masks = None
        if self.masks:  # [N, V] bool: unconstrained rows allow every token
            token_masks = np.ones((len(self.ids), vocab_size), bool)
            for first, mask in self.masks.items():
                token_masks[first:first + len(mask)] = mask
        return SamplingBatch.build(self.params, self.seeds, self.positions, self.histories,
                                   self.num_prompt_tokens, token_masks, eos_token_ids)

    def _add(self, req: Request, row: int, position: int, history: Sequence[int]) -> None:
        self.ids.append(row)
        self.params.append(req.params)
        self.seeds.append(req.seed)
        self.positions.append(position)
        self.histories.append(history)
        self.num_prompt_tokens.append(req.num_prompt_tokens)
