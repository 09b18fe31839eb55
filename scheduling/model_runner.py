"""ModelRunner: turns a StepPlan into one flat ForwardBatch, runs the target model over it, and says
which logits rows belong to which request.

Every scheduled token is one row: prefill chunks, decode tokens, and a speculating request's last
token followed by its drafts. Logits are kept for the rows whose next token is wanted: the last row of
a request that reaches the end of its tokens, every row of its drafts (k + 1 rows: after the last
verified token and after each draft), every row of a score() request, and the prompt rows a request with
prompt_logprobs has not scored yet (those come first among its rows). Final-norm hidden states are kept for
every row when a proposer reads them or an embed() request runs.
"""

from dataclasses import dataclass

import numpy as np

from memory.kv_cache import KVCache
from models.batch import ForwardBatch
from models.decoder import DecoderModel
from scheduling.lora.adapter_store import AdapterStore
from scheduling.lora.planner import LoraPlanner
from scheduling.plan import StepPlan


@dataclass(frozen=True)
class RunOutput:
    """Aligned with StepPlan.scheduled: logit_rows[i], first_rows[i], first_positions[i] are
    scheduled[i]'s."""

    logits: np.ndarray  # [R, V] f32
    logit_rows: list[slice | None]  # its logits rows to sample, or a score()'s every row (None: none)
    # its prompt rows to score for prompt_logprobs, from position prompt_starts[i] (None: none)
    prompt_rows: list[slice | None]
    prompt_starts: list[int]
    hidden: np.ndarray | None  # [T, H] f32: every row's final-norm hidden state, when wants_hidden
    first_rows: list[int]  # its first row in the flat batch (its rows are contiguous)
    first_positions: list[int]  # that row's position (its num_computed_tokens then)


class ModelRunner:
    def __init__(self, model: DecoderModel, kv_cache: KVCache, block_size: int, adapters: AdapterStore,
                 lora: LoraPlanner):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.adapters = adapters  # the engine's registry (shared, not copied)
        self.lora = lora
        self.wants_hidden = False  # a proposer drafts from the target's hidden states (of every row)

    def run(self, plan: StepPlan) -> "RunOutput":
        batch, logit_rows, prompt_rows, prompt_starts = self.build_batch(plan)
        self.model.projection_seconds = 0.0
        logits, hidden = self.model.forward_hidden(batch, self.kv_cache)
        self.lora.observe(self.model.projection_seconds)
        first_rows = [0] * len(plan.scheduled)
        # each request's rows are contiguous
        for row in np.flatnonzero(np.diff(batch.token_seq, prepend=-1) != 0):
            first_rows[batch.token_seq[row]] = int(row)
        return RunOutput(logits, logit_rows, prompt_rows, prompt_starts, hidden, first_rows,
                         [int(batch.positions[r]) for r in first_rows])

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[slice | None], list[slice | None],
                                                    list[int]]:
        bs = self.block_size
        token_ids, positions, slots, token_seq, logits_indices = [], [], [], [], []
        logit_rows: list[slice | None] = [None] * len(plan.scheduled)
        prompt_rows: list[slice | None] = [None] * len(plan.scheduled)
        prompt_starts = [0] * len(plan.scheduled)
        row_adapter: list[str | None] = []
        trees = []  # (first row of a tree's nodes, its first slot, the tree)
        max_blocks = max(len(s.request.block_ids) for s in plan.scheduled)
        block_tables = np.zeros((len(plan.scheduled), max_blocks), np.int32)  # [S, max_blocks]
        # rows of one adapter next to each other: the LoRA kernel takes each adapter's rows as one run
        order = sorted(range(len(plan.scheduled)), key=lambda i: plan.scheduled[i].request.adapter_id or "")
        for s in order:
            scheduled = plan.scheduled[s]
            req, n, tree = scheduled.request, scheduled.num_new_tokens, scheduled.tree
            start, row, num_base = req.num_computed_tokens, len(token_ids), scheduled.num_base_tokens
            token_ids += req.token_ids[start:start + num_base]
            token_ids += scheduled.draft_token_ids
            slots += range(start, start + n)  # in the sequence: a tree's nodes take the slots after its root
            if tree is None:
                positions += range(start, start + n)
            else:  # a node sits at the root's position plus its depth
                root = start + num_base - 1
                positions += [*range(start, start + num_base), *(root + d for d in tree.depths)]
                trees.append((row + num_base, start + num_base, tree))
            token_seq += [s] * n
            row_adapter += [req.adapter_id] * n
            # released (-1) blocks are never read
            block_tables[s, :len(req.block_ids)] = [max(b, 0) for b in req.block_ids]
            if req.params.prompt_logprobs is not None and not req.prompt_only:
                # positions first..end-1 score prompt tokens first+1..end (those scored before a preemption
                # are not again)
                first = max(start, len(req.prompt_logprobs))
                end = min(start + num_base, req.num_prompt_tokens - 1)
                if first < end:
                    prompt_rows[s] = slice(len(logits_indices), len(logits_indices) + end - first)
                    prompt_starts[s] = first
                    logits_indices += range(row + first - start, row + end - start)
            wanted = _sampled_rows(req, start, num_base, row, n)
            logit_rows[s] = slice(len(logits_indices), len(logits_indices) + len(wanted)) if wanted else None
            logits_indices += wanted
        positions = np.asarray(positions, np.int32)
        slots = np.asarray(slots, np.int64)
        token_seq = np.asarray(token_seq, np.int32)
        slot_mapping = block_tables[token_seq, slots // bs].astype(np.int64) * bs + slots % bs
        lora, merged = self.lora.plan(row_adapter, self.adapters.__getitem__)
        logits_indices = np.asarray(logits_indices, np.int64)
        tree_starts, tree_mask = _tree_arrays(len(token_ids), trees)
        pooling = any(s.request.pooling for s in plan.scheduled)
        every_row = np.arange(len(token_ids), dtype=np.int64) if self.wants_hidden or pooling else None
        wide_from = np.array([s.request.wide_from or 0 for s in plan.scheduled], np.int32)  # [S]
        batch = ForwardBatch(np.asarray(token_ids, np.int64), positions, token_seq, slot_mapping,
                             block_tables, logits_indices, lora, merged, every_row, tree_starts, tree_mask,
                             wide_from)
        return batch, logit_rows, prompt_rows, prompt_starts


def _sampled_rows(req, start: int, num_base: int, row: int, n: int) -> range:
    """Which of a request's n rows (from row) the step samples or returns logits of."""
    if req.pooling:
        return range(0)
    if req.prompt_logits:
        return range(row, row + n)
    if start + num_base == req.num_tokens:
        return range(row + num_base - 1, row + n)  # the last verified token, then each draft
    return range(0)  # a prefill chunk short of the prompt's end


def _tree_arrays(num_tokens: int, trees: list) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The attention kernel's tree inputs: tree_starts [T] int32 (-1 off trees), tree_mask [T, W] uint8."""
    if not trees:
        return None, None
    width = max(len(tree.tokens) for *_, tree in trees)
    tree_starts = np.full(num_tokens, -1, np.int32)
    tree_mask = np.zeros((num_tokens, width), np.uint8)
    for row, first_slot, tree in trees:
        n = len(tree.tokens)
        tree_starts[row:row + n] = first_slot
        tree_mask[row:row + n] = tree.mask(width)
    return tree_starts, tree_mask
