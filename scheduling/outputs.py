"""What a step hands on: the sampled tokens of every request (StepResult), the per-step delta of one
request (RequestOutput), and a finished completion (Completion)."""

from dataclasses import dataclass, field

import numpy as np


@dataclass
class StepResult:
    """The model runner's output for one step (vLLM v1's ModelRunnerOutput shape): per request that
    reached the end of its scheduled tokens, the tokens to append. A plain decode step appends one; a
    verification step appends the accepted drafts and one token of the target's (1 to k + 1)."""

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)  # per token, when asked
    num_draft_tokens: list[int] = field(default_factory=list)  # drafts verified per request (0: none; a tree: its depth)
    num_accepted_tokens: list[int] = field(default_factory=list)  # of those, accepted
    # per request, the offset in its logits rows of the row each token was sampled at (a chain: 0, 1, ...;
    # a tree: the rows of its accepted path)
    sampled_rows: list[list[int]] = field(default_factory=list)
    prompt_logits: dict[str, np.ndarray] = field(default_factory=dict)  # score(): request id -> [n, V]

    def add(self, req_id: str, token_ids: list[int], logprobs: list[dict[int, float]] | None,
            num_drafts: int = 0, num_accepted: int = 0, rows: list[int] | None = None) -> None:
        self.req_ids.append(req_id)
        self.sampled_token_ids.append(token_ids)
        self.logprobs.append(logprobs)
        self.num_draft_tokens.append(num_drafts)
        self.num_accepted_tokens.append(num_accepted)
        self.sampled_rows.append(list(range(len(token_ids))) if rows is None else rows)


@dataclass
class RequestOutput:
    """New tokens and text of one request from one step."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when the request asked for them

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
