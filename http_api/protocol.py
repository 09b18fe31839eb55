"""The OpenAI API's request bodies (pydantic, strict: a wrong type is a 400 naming the field) and how one
becomes SamplingParams. OpenAI's fields and defaults, vLLM's extensions where OpenAI has none (top_k, min_p,
repetition_penalty, ignore_eos, stop_token_ids). A null field means its default, as OpenAI treats it: every
body drops its null fields before validation (a required one is then missing)."""

import json
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    StrictStr,
    ValidationError,
    WrapValidator,
    model_validator,
)

from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from cluster_configs.structured_outputs import StructuredOutputs
from http_api.errors import APIError
from http_api.structured import StructuredFields
from scheduling.sampling.best_of import candidate_params

MAX_LOGPROBS = 20  # OpenAI's bound, and the engine's (scheduling/validation.py)
MAX_CHOICES = 128  # prompts x n of one request: each is a request to the deployment
MAX_TEMPERATURE = 100.0  # past it a draw is uniform to float32 precision
MAX_REPETITION_PENALTY = 100.0  # past it a repeated token's logit is 0 or -inf to float32 precision

TokenIds = Annotated[list[StrictInt], Field(min_length=1)]


def _token_ids_as_they_are(value, validate):
    """A non-empty list of ints passes at C speed: the union below would first try it as a list of strings
    and make one error per id, which in the event loop held up every stream for a long prompt's body."""
    if type(value) is list and value and set(map(type, value)) == {int}:
        return value
    return validate(value)


# a prompt or an embedding input: a string, strings, token ids, or lists of token ids
Prompts = Annotated[StrictStr | list[StrictStr] | TokenIds | list[TokenIds],
                    WrapValidator(_token_ids_as_they_are)]


class Body(BaseModel):
    """A request body (or an object in one): strict types, no unknown fields, null = absent."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class StreamOptions(Body):
    include_usage: bool = False  # a last chunk with the usage of the whole request and no choices


class _Sampling(StructuredFields, Body):
    """Fields both endpoints share (and those constraining the output: http_api/structured.py)."""

    model: str | None = None  # the served model's name or a registered adapter's; None: the served model
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE, description="0 = greedy; default 1")
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_CHOICES,
                   description="completions per prompt; with a seed, choice i uses seed + i")
    stop: StrictStr | list[StrictStr] | None = Field(
        None, description="strings that end a completion (not included)")
    seed: int | None = Field(None, ge=0, lt=2**63)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # the tenant when the server has no API keys: its cache salt and concurrency bound
    user: str | None = None
    # OpenAI's, accepted and without effect here (no stored completions, one service tier)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    cache_salt: StrictStr | None = Field(None, min_length=1, description="share cached prefix blocks only "
                                         "with requests of the same salt (and tenant)")  # vLLM's
    # vLLM's extensions
    top_k: int | None = Field(None, ge=-1, description="0 or -1 = off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    priority: int = Field(0, description='lower runs first under scheduling_policy "priority"')
    # numaserve's: seconds the request may take; past it a request is aborted
    # (default: http.default_deadline_s)
    deadline_s: float | None = Field(None, gt=0.0, le=86_400.0)
    # ---- issue #28's request options: OpenAI's logit_bias and best_of, vLLM's min_tokens and prompt_logprobs
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string, as OpenAI's) -> bias "
                                                "in [-100, 100] added to its logit")
    min_tokens: int | None = Field(None, ge=0, description="EOS, stop_token_ids and stop strings end nothing "
                                   "before this many tokens; default 0")
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description="candidates per prompt, of which the "
                                "n of highest cumulative logprob are returned; not with stream")
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                        description="the prompt tokens' logprobs and this many most likely")

    @property
    def ranks_candidates(self) -> bool:
        """Whether best_of candidates are generated and the n best returned (best_of = n: the n choices)."""
        return self.best_of is not None and self.best_of > self.n

    @property
    def num_candidates(self) -> int:
        """Requests per prompt."""
        return self.best_of if self.ranks_candidates else self.n

    def check_best_of(self) -> None:
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(400, f"best_of={self.best_of} is less than n={self.n}; best_of must be >= n",
                           param="best_of")
        if self.ranks_candidates and self.stream:
            raise APIError(400, f"best_of={self.best_of} > n={self.n} cannot be used with stream: the best "
                                "candidates are known only at the end; drop one", param="best_of")

    def _bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        try:
            return {int(t): b for t, b in self.logit_bias.items()}
        except ValueError:
            bad = [t for t in self.logit_bias if not t.strip().lstrip("-").isdigit()]
            raise APIError(400, f"logit_bias keys must be token ids (strings of integers), got {bad[:5]}",
                           param="logit_bias") from None
    # ---- end of issue #28's request options

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, max_tokens: int, logprobs: int | None, deadline_s: float | None = None,
                        structured_outputs: StructuredOutputs | None = None,
                        prompt_logprobs: int | None = None) -> list[SamplingParams]:
        """One SamplingParams per choice (n), or per candidate (best_of, scheduling/sampling/best_of.py): a
        seeded request's choice i is seeded with seed + i."""
        fields = {"max_tokens": max_tokens, "logprobs": logprobs, "ignore_eos": self.ignore_eos,
                  "deadline_s": deadline_s, "priority": self.priority, "seed": self.seed,
                  "structured_outputs": structured_outputs,
                  "min_tokens": self.min_tokens or 0,
                  "logit_bias": self._bias(),
                  "prompt_logprobs": self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs}
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "min_p",
                     "repetition_penalty"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if self.top_k is not None:
            fields["top_k"] = max(self.top_k, 0)
        if self.stop is not None:
            fields["stop"] = self.stop
        if self.stop_token_ids is not None:
            fields["stop_token_ids"] = tuple(self.stop_token_ids)
        try:
            base = SamplingParams(**fields)
        except ValidationError as e:  # what the fields' own bounds let through (e.g. an empty stop string)
            err = e.errors()[0]
            param = str(err["loc"][0]) if err["loc"] else None
            prefix = f"{param}: " if param else ""
            raise APIError(400, prefix + err["msg"].removeprefix("Value error, "), param=param,
                           code="invalid_value") from None
        if self.ranks_candidates:
            return candidate_params(base, self.best_of)
        if self.seed is None:
            return [base] * self.n
        return [base.model_copy(update={"seed": self.seed + i}) for i in range(self.n)]


class CompletionRequest(_Sampling):
    prompt: Prompts = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    max_tokens: int | None = Field(16, ge=1, description="tokens to generate at most; default 16")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log-probabilities of the sampled token and this many most "
                                             "likely")
    echo: bool = False  # the prompt's text before each completion
    # fill in the middle: needs the model's FIM tokens (http_api/fill_in_middle.py)
    suffix: StrictStr | None = None

    def prompts(self) -> list[str | list[int]]:
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        if not self.prompt:
            raise InvalidRequest("prompt: the list is empty; pass a string, token ids, or a non-empty list "
                                 "of them")
        return list(self.prompt)


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCall(Body):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(Body):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(Body):
    # other keys (name, tool_call_id, ...) reach the template as they are, as with apply_chat_template
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal[ROLES]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls, sent back

    def template_message(self) -> dict:
        """The message as templates read it: text parts joined (as vLLM does for string-content templates),
        a call's arguments as an object (templates write them with tojson, as transformers' docs show)."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "\n".join(part.text for part in self.content)
        for call in message.get("tool_calls", ()):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                arguments = call["function"]["arguments"]
                raise InvalidRequest(f"a tool call's arguments are not JSON ({arguments!r:.60}); send them "
                                     "back as the server returned them", param="messages") from None
        return message


class FunctionDefinition(Body):
    name: StrictStr = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: StrictStr | None = None
    parameters: dict | None = None  # a JSON Schema; None: no parameters
    strict: bool | None = None  # changes nothing: calls under "required" or a named function are enforced


class Tool(Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Body):
    name: StrictStr


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI for max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="needs logprobs: true")
    # tool calling (http_api/tool_calls.py)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools
    parallel_tool_calls: bool = True

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs: true; set it, or drop top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class LoadLoraAdapterRequest(Body):
    lora_name: str
    # a NUL in a path makes the os calls raise ValueError (it was a 500)
    lora_path: str = Field(pattern=r"^[^\x00]+$", description="the adapter's folder on the server")


class UnloadLoraAdapterRequest(Body):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names are what numaserve serves adapters by


class TokenizeRequest(Body):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template (exactly one)."""

    model: str | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template's)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[StrictInt]


class EmbeddingRequest(Body):
    """/v1/embeddings (OpenAI's): each input's pooled final hidden states (the server's --pooling)."""

    model: str | None = None
    input: Prompts = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists")
    encoding_format: Literal["float", "base64"] = "float"  # base64: the little-endian float32 bytes
    user: str | None = None

    def inputs(self) -> list[str | list[int]]:
        if isinstance(self.input, str) or (self.input and isinstance(self.input[0], int)):
            return [self.input]
        if not self.input:
            raise InvalidRequest("input: the list is empty; pass a string, token ids, or a non-empty list of "
                                 "them")
        if len(self.input) > MAX_CHOICES:
            raise APIError(400, f"input: {len(self.input)} inputs; at most {MAX_CHOICES} per request",
                           param="input")
        return list(self.input)
