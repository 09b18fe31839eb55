"""Verification of drafted tokens against one target forward: pure functions over arrays.

The target forward of a speculating request yields k + 1 next-token distributions: after its last
verified token and after each of its k drafts. Both rules return the tokens to append: the accepted
drafts followed by one token of the target's own (a correction at the first rejection, else a bonus),
so every verification step appends between 1 and k + 1 tokens.

- Greedy: accept the longest prefix of drafts equal to the target's argmax, then the target's argmax.
- Sampled: the standard rejection rule (Leviathan et al. 2023, Chen et al. 2023): accept draft i with
  probability min(1, p_i(x) / q_i(x)); at the first rejection sample from normalize(max(0, p_i - q_i));
  when all k pass sample a bonus token from p_k. The appended tokens are distributed exactly as if
  sampled from p one by one, provided each draft was drawn from q_i (q = None: drafts are a
  deterministic guess, q one-hot, as for n-gram lookup or greedy drafting).

Randomness comes in as uniforms [k + 1, 2] (row i: column 0 decides draft i, column 1 samples the
token appended at offset i), so the caller can key the draws by (seed, position) of each token.
"""

import numpy as np


def accept_greedy(target_argmax: np.ndarray, drafts: list[int]) -> list[int]:
    # target_argmax: [k + 1] int, the target's argmax after the last verified token and after each draft
    out = []
    for i, d in enumerate(drafts):
        t = int(target_argmax[i])
        if t != d:
            out.append(t)
            return out
        out.append(d)
    out.append(int(target_argmax[len(drafts)]))
    return out


def verify_greedy(target_logits: np.ndarray, drafts: list[int]) -> list[int]:
    # target_logits: [k + 1, V] (after penalties)
    return accept_greedy(np.argmax(target_logits, axis=-1), drafts)


def sample_with_uniform(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from probs [V] (need not be normalized) with one uniform u in [0, 1)."""
    cdf = np.cumsum(probs, dtype=np.float64)
    return int(min(np.searchsorted(cdf, u * cdf[-1], side="right"), len(cdf) - 1))


def verify_sampled(target_probs: np.ndarray, drafts: list[int], draft_probs: np.ndarray | None,
                   uniforms: np.ndarray | np.random.Generator) -> list[int]:
    """target_probs: [k + 1, V], the distributions the request samples from (penalties, temperature and
    top-k / top-p / min-p applied); draft_probs: [k, V] the distributions the drafts were drawn from, or
    None for one-hot q; uniforms: [k + 1, 2] in [0, 1), or a Generator to draw them from."""
    k = len(drafts)
    if isinstance(uniforms, np.random.Generator):
        uniforms = uniforms.random((k + 1, 2))
    out = []
    for i, d in enumerate(drafts):
        p = target_probs[i]
        if draft_probs is None:
            accept = uniforms[i, 0] < p[d]  # q(d) = 1
        else:
            q = draft_probs[i]
            accept = uniforms[i, 0] * q[d] < p[d]  # u < p/q without dividing by a zero q
        if accept:
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.astype(np.float64, copy=True)
            residual[d] = 0.0  # max(0, p - onehot(d))
        else:
            residual = np.maximum(p.astype(np.float64) - draft_probs[i], 0.0)
        if not residual.sum() > 0.0:
            residual = p  # p == q up to rounding: a rejection had probability ~0
        out.append(sample_with_uniform(residual, uniforms[i, 1]))
        return out
    out.append(sample_with_uniform(target_probs[k], uniforms[k, 1]))
    return out
