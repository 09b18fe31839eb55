"""Prompt lookup: draft the continuation of the most recent earlier occurrence of a sequence's last n
tokens."""

from numba import njit


@njit(cache=True, nogil=True)
def ngram_lookup(token_ids, min_n, max_n, out):
    """-> number of tokens drafted into out[:count] (0 when no n-gram of size min_n..max_n recurs).

    token_ids: [L] int64, prompt + output; out: [max_draft] int64. The last n tokens are searched for,
    largest n first, at start positions s < L - n, latest first. The draft is what followed the match,
    continued periodically when it runs into the end: token L + j copies token s + n + j, so a repeating
    pattern (a period of L - n - s tokens) keeps repeating for the whole draft.
    """
    L = token_ids.shape[0]
    max_draft = out.shape[0]
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for s in range(L - n - 1, -1, -1):
            match = True
            for j in range(n):
                if token_ids[s + j] != token_ids[L - n + j]:
                    match = False
                    break
            if match:
                for j in range(max_draft):
                    src = s + n + j
                    out[j] = token_ids[src] if src < L else out[src - L]
                return max_draft
    return 0
