"""SamplingParams: how one request is decoded. Frozen and validated at construction."""

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cluster_configs.structured_outputs import StructuredOutputs

# below this a temperature samples the argmax (up to exact ties), and logits / temperature may overflow: such
# a request is greedy (vLLM's sampler keeps the same floor)
MIN_TEMPERATURE = 1e-5


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)  # inf temperature: NaN logits

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # 0 (below MIN_TEMPERATURE) = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    # > 1 discourages repeating prompt and output tokens, < 1 favours it;
    # the floor keeps logits / penalty finite
    repetition_penalty: float = Field(1.0, ge=1e-6)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # seconds the request may take from its arrival; past it the engine aborts it (finish_reason "abort") and
    # frees its KV blocks. The router hands a worker what is left of it. None: no deadline
    deadline_s: float | None = Field(None, gt=0.0, le=86_400.0)
    # lower runs first (vLLM's); honoured in admission, scheduling and preemption when the engine's
    # scheduling_policy is "priority", ignored under "fcfs"
    priority: int = 0
    # the output must match this JSON Schema / regex / choice / grammar (scheduling/sampling/structured.py)
    structured_outputs: StructuredOutputs | None = None
    # token id -> added to its logit before sampling (OpenAI's bounds); ids are checked against the vocabulary
    # in scheduling/validation.py
    logit_bias: dict[int, float] | None = None
    # EOS and stop_token_ids cannot be sampled, and stop strings end nothing, before this many output tokens
    min_tokens: int = Field(0, ge=0)
    # candidates generated, of which the n with the highest cumulative logprob are returned
    # (scheduling/sampling/best_of.py); None: n
    best_of: int | None = Field(None, ge=1, le=128)
    # the prompt's tokens scored: each one's logprob given the ones before, and this many most likely
    prompt_logprobs: int | None = Field(None, ge=0, le=20)

    @field_validator("logit_bias")
    @classmethod
    def _bias_bounds(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        bad = {t: b for t, b in (v or {}).items() if not -100.0 <= b <= 100.0}
        if bad:
            raise ValueError(f"logit_bias values must lie in [-100, 100]; got {bad}")
        return v

    @model_validator(mode="after")
    def _min_tokens_within_max(self) -> "SamplingParams":
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}")
        return self

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_tuple(cls, v):
        return (v,) if isinstance(v, str) else tuple(v)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1
