"""Request validation: the one place a request is checked against a model and an engine.

A deployment's callers (ns.Client, the HTTP actor) call `validate_request` before they ask the router to
place a request (with what they know: the vocabulary, the registered adapters, max_model_len), the engine
calls it in make_request with every limit, before any work. Each failure is an InvalidRequest that names
the problem and the fix.

Lengths: a prompt may take up to max_model_len - 1 tokens, leaving room for one generated token; a prompt
computed for its outputs alone (prompt_only: `LLM.score`, `LLM.embed`) may fill max_model_len. prompt +
max_tokens may exceed max_model_len: generation then stops at max_model_len with finish_reason "length".
What the request may grow to must fit the KV pool when the engine's layers keep all their KV (no sliding
window).
"""

from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from cluster_configs.errors import InvalidRequest
from cluster_configs.sampling_params import SamplingParams
from scheduling.sampling.structured import grammar_of

MAX_LOGPROBS = 20  # SamplingParams refuses more at construction too
# A token spells at most the vocabulary's longest token's characters of the text it came from, but a
# normalizer may compose characters first (NFC joins up to 3 Hangul jamo into one): 4x leaves room for that.
TEXT_CHARS_PER_TOKEN_SLACK = 4


@dataclass(frozen=True)
class RequestLimits:
    """What a request is validated against. None: not known to the caller (the engine knows them all)."""
    vocab_size: int
    max_model_len: int | None = None
    max_logprobs: int = MAX_LOGPROBS
    block_size: int | None = None
    num_kv_blocks: int | None = None  # None also when sliding-window layers free blocks as they go


def validate_request(prompt, params: SamplingParams | None, limits: RequestLimits, *, tokenizer=None,
                     adapter: str | None = None, adapters: Collection[str] | None = None,
                     cache_salt: str | None = None,
                     prompt_only: bool = False) -> tuple[list[int], SamplingParams]:
    """-> (prompt token ids, params) of a servable request, else InvalidRequest.

    prompt: a str (needs tokenizer, with .encode) or a list / tuple / array of int token ids; params None:
    the defaults; adapters: the registered adapter names (None: not checked here); cache_salt: None or a
    non-empty str."""
    params = check_params(params)
    if cache_salt is not None and not (isinstance(cache_salt, str) and cache_salt):
        raise InvalidRequest(f"cache_salt must be a non-empty str or None, got {cache_salt!r:.60}",
                             param="cache_salt")
    if adapter is not None and adapters is not None:
        check_adapter(adapter, adapters)
    if isinstance(prompt, str) and tokenizer is not None:
        check_text_length(len(prompt), tokenizer.max_token_chars, limits, prompt_only)
    elif isinstance(prompt, (list, tuple, np.ndarray)):
        check_length(len(prompt), params, limits, prompt_only)  # before a long list is checked id by id
    prompt_ids = encode_prompt(prompt, tokenizer, limits.vocab_size)
    check_length(len(prompt_ids), params, limits, prompt_only)
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequest(f"{name} {bad[:5]} are outside the vocabulary [0, {limits.vocab_size}); "
                                 "pass ids the model can generate", param=name)
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > limits.max_logprobs:
            raise InvalidRequest(f"{name}={k} exceeds this engine's limit of {limits.max_logprobs}; "
                                 f"ask for at most {limits.max_logprobs}", param=name)
    if params.structured_outputs is not None:
        grammar_of(params.structured_outputs)
    if params.best_of not in (None, 1):  # LLM.generate and the HTTP API submit its candidates instead
        raise InvalidRequest(f"best_of={params.best_of} is served by LLM.generate and the HTTP API, which "
                             "generate the candidates; a stream, a session turn or a client request is one "
                             "sequence: drop best_of", param="best_of")
    return prompt_ids, params


def check_params(params) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if not isinstance(params, SamplingParams):
        raise InvalidRequest(f"params must be a numaserve.SamplingParams, got {type(params).__name__}")
    return params


def check_adapter(adapter, adapters: Collection[str]) -> None:
    if not isinstance(adapter, str):
        raise InvalidRequest(f"adapter must be a registered adapter's name (a str) or None, got "
                             f"{type(adapter).__name__}")
    if adapter not in adapters:
        known = ", ".join(sorted(adapters)) or "none"
        raise InvalidRequest(f"unknown adapter {adapter!r} (registered: {known}); register it first with "
                             "register_adapter(name, path)")


def encode_prompt(prompt, tokenizer, vocab_size: int) -> list[int]:
    """The prompt's token ids: a str through the tokenizer, or int ids, each within the vocabulary."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequest("the prompt is empty; pass at least one character or token", param="prompt")
        if tokenizer is None:
            raise InvalidRequest("this model directory has no tokenizer.json; pass token ids instead of text",
                                 param="prompt")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple, np.ndarray)) and all(
            isinstance(t, (int, np.integer)) and not isinstance(t, (bool, np.bool_)) for t in prompt):
        ids = [int(t) for t in prompt]
    else:
        raise InvalidRequest(f"a prompt is a str or a list of int token ids, got {type(prompt).__name__}",
                             param="prompt")
    if not ids:
        raise InvalidRequest("the prompt is empty; pass at least one token", param="prompt")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"token ids {bad[:5]} are outside the vocabulary [0, {vocab_size}); pass ids of "
                             "this model's tokenizer", param="prompt")
    return ids


def max_num_tokens(num_prompt_tokens: int, params: SamplingParams, max_model_len: int,
                   prompt_only: bool) -> int:
    """The length a request may reach: prompt + max_tokens (the prompt alone when scored), at most
    max_model_len."""
    return min(max_model_len, num_prompt_tokens + (0 if prompt_only else params.max_tokens))


def check_text_length(num_chars: int, max_token_chars: int, limits: RequestLimits,
                      prompt_only: bool) -> None:
    """Refuse a text prompt too long for max_model_len whatever its tokens, before tokenizing it (a 5 MB
    prompt takes seconds to tokenize, and would be refused after)."""
    if limits.max_model_len is None:
        return
    limit = limits.max_model_len if prompt_only else limits.max_model_len - 1
    if num_chars > limit * max_token_chars * TEXT_CHARS_PER_TOKEN_SLACK:
        raise InvalidRequest(f"prompt has {num_chars} characters, more than max_model_len="
                             f"{limits.max_model_len} tokens can hold (at most {limit} tokens of at most "
                             f"{max_token_chars} characters each); shorten the prompt", param="prompt")


def check_length(num_prompt_tokens: int, params: SamplingParams, limits: RequestLimits,
                 prompt_only: bool) -> None:
    if limits.max_model_len is None:
        return
    limit = limits.max_model_len if prompt_only else limits.max_model_len - 1
    if num_prompt_tokens > limit:
        raise InvalidRequest(f"prompt has {num_prompt_tokens} tokens but "
                             f"max_model_len={limits.max_model_len} "
                             f"leaves room for at most {limit}; shorten the prompt", param="prompt")
    if limits.num_kv_blocks is None or limits.block_size is None:
        return
    num_blocks = -(-max_num_tokens(num_prompt_tokens, params, limits.max_model_len, prompt_only)
                   // limits.block_size)
    if num_blocks > limits.num_kv_blocks:
        raise InvalidRequest(f"request needs up to {num_blocks} KV blocks "
                             f"but the pool has {limits.num_kv_blocks}; "
                             "lower max_tokens or raise kv_cache_bytes", param="max_tokens")
