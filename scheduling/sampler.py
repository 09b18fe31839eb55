"""Turn one request's next-token logits into a token: penalties, temperature, top-k, top-p, min-p.

Filters follow the usual serving semantics: top_k keeps the k most likely tokens, top_p the smallest
set whose probability reaches top_p, min_p the tokens with probability >= min_p * the top probability.
"""

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
    if params.greedy:
        return int(np.argmax(logits))
    probs = sampling_probs(logits, params)
    cdf = np.cumsum(probs)
    return int(min(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"), len(cdf) - 1))


def top_logprobs(logits: np.ndarray, token_id: int, k: int) -> dict[int, float]:
    """The sampled token's log-probability and the k most likely ones, under the raw model distribution."""
    x = logits.astype(np.float64)
    logsumexp = x.max() + np.log(np.exp(x - x.max()).sum())
    top = np.argpartition(-x, k)[:k] if 0 < k < x.shape[0] else np.arange(x.shape[0] if k else 0)
    top = top[np.argsort(-x[top], kind="stable")]
    out = {int(t): float(x[t] - logsumexp) for t in top}
    out.setdefault(int(token_id), float(x[token_id] - logsumexp))
    return out
