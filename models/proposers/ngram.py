"""NgramProposer: prompt lookup over each request's prompt + output (no model, q one-hot)."""

from collections.abc import Sequence

import numpy as np

from cluster_configs.speculation_config import SpeculationConfig
from kernels.ngram import ngram_lookup
from models.proposers.base import Proposer, SpecRequest


class NgramProposer(Proposer):
    def __init__(self, config: SpeculationConfig):
        super().__init__()
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max
        self._arrays: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (token buffer, tokens in it)

    def propose(self, requests: Sequence[SpecRequest], depths: Sequence[int]) -> list[list[int]]:
        drafts = []
        for req, depth in zip(requests, depths):
            if depth <= 0:
                drafts.append([])
                continue
            token_ids = self._token_array(req)
            out = np.empty(depth, np.int64)
            n = ngram_lookup(token_ids, self.min_n, self.max_n, out)
            drafts.append(out[:n].tolist())
        return drafts

    def free(self, request_id: str) -> None:
        self._arrays.pop(request_id, None)

    def _token_array(self, req: SpecRequest) -> np.ndarray:
        """The request's tokens as int64, appended to a kept buffer instead of converted every step."""
        buf, n = self._arrays.get(req.request_id, (None, 0))
        L = len(req.token_ids)
        # verified tokens only grow (never edited in place); a shorter list or a changed last token means
        # the request was rebuilt
        if buf is None or L < n or (n and req.token_ids[n - 1] != buf[n - 1]):
            buf, n = np.empty(max(64, 2 * L), np.int64), 0
        if L > buf.shape[0]:
            buf = np.concatenate([buf[:n], np.empty(2 * L - n, np.int64)])
        buf[n:L] = req.token_ids[n:L]
        self._arrays[req.request_id] = (buf, L)
        return buf[:L]
