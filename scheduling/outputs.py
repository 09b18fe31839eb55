"""What the stages of a step hand on: the sampler's tokens per scheduled request (SamplerOutput), the
per-step delta of one request (RequestOutput), the step's outputs and stats (StepOutput), and a finished
completion (Completion)."""

from dataclasses import dataclass, field

import numpy as np

from scheduling.step_stats import StepStats


@dataclass(frozen=True)
class SampledTokens:
    """The tokens one request appends this step (vLLM v1's ModelRunnerOutput, one row): a plain decode step
    appends one; a verification appends the accepted drafts and one token of the target's (1 to k + 1)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per token, when the request asked for them
    num_draft_tokens: int  # drafts verified (0: none; a tree: its depth)
    num_accepted_tokens: int  # of those, accepted
    rows: list[int]  # offset in its logits rows of the row each token was sampled at (a tree: its kept path)


@dataclass(frozen=True)
class SamplerOutput:
    """Aligned with StepPlan.scheduled."""

    sampled: tuple[SampledTokens | None, ...]  # None: no token this step (a prefill chunk short of the end)
    # of this step's rows: a score() request's logits [n, V], an embed() request's hidden states [n, H]
    collected: tuple[np.ndarray | None, ...]
    # prompt_logprobs: the next prompt tokens' logprobs this step scored (None: none)
    prompt_logprobs: tuple[list[dict[int, float]] | None, ...]


@dataclass
class RequestOutput:
    """New tokens and text of one request from one step."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    logprobs: list[dict[int, float]] | None = None  # per token of token_ids, when the request asked for them
    # in its first output with tokens, when asked: per prompt token, None for the first (vLLM's shape)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepOutput:
    outputs: list[RequestOutput]  # one per request with new tokens or finished (deadlines passed included)
    stats: StepStats


@dataclass
class Completion:
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per generated token: {token_id: logprob}
    # per prompt token, None for the first (params.prompt_logprobs)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def from_request(cls, req) -> "Completion":
        """A finished request's completion (req: scheduling.request.Request)."""
        return cls(prompt_token_ids=req.token_ids[:req.num_prompt_tokens], token_ids=req.output_token_ids,
                   text=req.text, finish_reason=req.finish_reason,
                   logprobs=req.logprobs if req.params.logprobs is not None else None,
                   prompt_logprobs=([None, *req.prompt_logprobs]
                                    if req.params.prompt_logprobs is not None else None))
