"""The reference sampler: one request at a time, as the engine sampled before scheduling/sampling/sampler.py's
batched sample_batch. The tests (and benchmarks/spec_coupling.py) check the batched code against it: the same
greedy tokens, the same penalties, the same distributions. The engine does not call it."""

import numpy as np

from cluster_configs.sampling_params import SamplingParams


def apply_penalties(logits: np.ndarray, prompt_ids: list[int], output_ids: list[int],
                    params: SamplingParams) -> np.ndarray:
    # logits: [V] f32, modified copy
    logits = logits.copy()
    if params.repetition_penalty != 1.0:
        seen = np.unique(np.asarray(prompt_ids + output_ids, np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.presence_penalty or params.frequency_penalty):
        ids, counts = np.unique(np.asarray(output_ids, np.int64), return_counts=True)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def sampling_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The distribution a non-greedy request samples from: [V] float64, sums to 1."""
    x = logits.astype(np.float64) / params.temperature
    if 0 < params.top_k < x.shape[0]:
        kth = np.partition(x, -params.top_k)[-params.top_k]
        x[x < kth] = -np.inf
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    if params.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cumulative = np.cumsum(probs[order])
        drop = cumulative - probs[order] >= params.top_p  # tokens after the set already reached top_p
        probs[order[drop]] = 0.0
    if params.min_p > 0.0:
        probs[probs < params.min_p * probs.max()] = 0.0
    return probs / probs.sum()


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """One request's token from a counted generator, as the engine sampled before sample_batch: the reference
    sample_batch is tested against (the same greedy tokens, the same distribution). The engine does not call
    it."""
    if params.greedy:
        return int(np.argmax(logits))
    probs = sampling_probs(logits, params)
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))

