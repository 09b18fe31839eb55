"""SamplingBatch: what sampling one step's logits rows needs, as arrays built once (vLLM's SamplingMetadata).

Row i is one logits row to sample: its request's parameters, the seed and position that key its draw
(kernels/sampling/race.py), for penalties the token ids before that position, and the sparse additions to its
logits: its logit_bias, and -inf on EOS and its stop_token_ids while its output is shorter than min_tokens.
The engine builds one per step (scheduling/sampling/step_sampler.py: a verification's row after draft j sees
drafts 0..j as output); a draft model builds its own for its rows (models/proposers/draft.py).
"""

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cluster_configs.sampling_params import SamplingParams


@dataclass(frozen=True)
class SamplingBatch:
    greedy: np.ndarray  # [N] bool
    temperatures: np.ndarray  # [N] float64
    top_k: np.ndarray  # [N] int64 (0: off)
    top_p: np.ndarray  # [N] float64
    min_p: np.ndarray  # [N] float64
    seeds: np.ndarray  # [N] uint64
    positions: np.ndarray  # [N] int64: where the row's token will sit (keys its draw)
    repetition_penalties: np.ndarray  # [N] float32 (1: off)
    frequency_penalties: np.ndarray  # [N] float64
    presence_penalties: np.ndarray  # [N] float64
    # per row: prompt + output token ids before its position; only rows that set a penalty are read
    # (others: ())
    histories: tuple[Sequence[int], ...]
    num_prompt_tokens: np.ndarray  # [N] int64: of each history, the prompt's
    token_masks: np.ndarray | None = None  # [N, V] bool: the tokens a row may take (None: every token)
    # (rows [K] int64, token ids [K] int64, values [K] float32): logits[rows, ids] += values, before penalties
    # (vLLM's order); None: no row has one
    logit_adds: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def build(cls, params: Sequence[SamplingParams], seeds: Sequence[int], positions: Sequence[int],
              histories: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int],
              token_masks: np.ndarray | None = None,
              eos_token_ids: Sequence[int] = ()) -> "SamplingBatch":
        positions = np.asarray(positions, np.int64).reshape(-1)
        num_prompt_tokens = np.asarray(num_prompt_tokens, np.int64).reshape(-1)
        return cls(np.array([p.greedy for p in params], bool),
                   np.array([p.temperature for p in params], np.float64),
                   np.array([p.top_k for p in params], np.int64),
                   np.array([p.top_p for p in params], np.float64),
                   np.array([p.min_p for p in params], np.float64), np.asarray(seeds, np.uint64).reshape(-1),
                   positions,
                   np.array([p.repetition_penalty for p in params], np.float32),
                   np.array([p.frequency_penalty for p in params], np.float64),
                   np.array([p.presence_penalty for p in params], np.float64), tuple(histories),
                   num_prompt_tokens, token_masks,
                   logit_adds(params, positions - num_prompt_tokens, eos_token_ids))

    @property
    def num_rows(self) -> int:
        return self.greedy.shape[0]

    def rows(self, idx: np.ndarray) -> "SamplingBatch":
        """The batch of rows idx (in that order)."""
        return SamplingBatch(self.greedy[idx], self.temperatures[idx], self.top_k[idx], self.top_p[idx],
                             self.min_p[idx], self.seeds[idx], self.positions[idx],
                             self.repetition_penalties[idx],
                             self.frequency_penalties[idx], self.presence_penalties[idx],
                             tuple(self.histories[i] for i in idx), self.num_prompt_tokens[idx],
                             None if self.token_masks is None else self.token_masks[idx],
                             self._adds_of_rows(idx))

    def _adds_of_rows(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        if self.logit_adds is None:
            return None
        rows, ids, values = self.logit_adds
        new_row = np.full(self.num_rows, -1, np.int64)
        new_row[idx] = np.arange(len(idx))
        keep = new_row[rows] >= 0
        return (new_row[rows[keep]], ids[keep], values[keep]) if keep.any() else None


def logit_adds(params: Sequence[SamplingParams], num_output_tokens: np.ndarray, eos_token_ids: Sequence[int]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The sparse additions to each row's logits: its logit_bias, and -inf on its stop tokens (EOS unless
    ignore_eos, and stop_token_ids) while the row's output index num_output_tokens[i] < min_tokens."""
    rows, ids, values = [], [], []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            ids += p.logit_bias.keys()
            values += p.logit_bias.values()
        if num_output_tokens[i] < p.min_tokens:
            banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            rows += [i] * len(banned)
            ids += banned
            values += [-np.inf] * len(banned)
    if not rows:
        return None
    return np.asarray(rows, np.int64), np.asarray(ids, np.int64), np.asarray(values, np.float32)


def sets_penalty(params: SamplingParams) -> bool:
    """Whether sampling params's rows read their histories."""
    return params.repetition_penalty != 1.0 or bool(params.presence_penalty or params.frequency_penalty)
