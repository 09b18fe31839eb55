"""What the engine hands back: a per-step delta of one request, and a finished completion."""

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    """New tokens and text of one request from one step."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished

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
