"""best_of: a request's candidates, and which of them are returned (vLLM's semantics before v1).

best_of candidates are generated as independent requests (a seeded request's candidate i is seeded seed + i,
so the set is reproducible and candidate i equals choice i of a request with n = best_of); the n with the
highest cumulative logprob (the sum of each sampled token's logprob under the model's distribution, as
logprobs report it) are returned, best first. Candidates ask for logprobs (at least the sampled token's) to be
ranked; the caller drops them when the request did not ask.
"""

from collections.abc import Sequence

from cluster_configs.sampling_params import SamplingParams


def candidate_params(params: SamplingParams, num_candidates: int) -> list[SamplingParams]:
    """One SamplingParams per candidate: logprobs at least 0, a seeded request's candidate i seeded
    seed + i."""
    update = {"logprobs": params.logprobs or 0, "best_of": None}
    return [params.model_copy(update=update | ({} if params.seed is None else {"seed": params.seed + i}))
            for i in range(num_candidates)]


def cumulative_logprob(token_ids: Sequence[int], logprobs: Sequence[dict[int, float]]) -> float:
    return float(sum(row[t] for t, row in zip(token_ids, logprobs)))


def best(n: int, candidates: Sequence[tuple[Sequence[int], Sequence[dict[int, float]]]]) -> list[int]:
    """Indices of the n candidates (token ids, their logprobs) of highest cumulative logprob, best first
    (ties: the earlier candidate)."""
    scores = [cumulative_logprob(ids, lps) for ids, lps in candidates]
    return sorted(range(len(candidates)), key=lambda i: -scores[i])[:n]
