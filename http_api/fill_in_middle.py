"""/v1/completions' `suffix`: fill in the middle, for models trained with FIM tokens. The prompt becomes
prefix-suffix-middle order (<PRE> prompt <SUF> suffix <MID>), in the first token set the vocabulary has:
StarCoder's and Qwen2.5-Coder's. A model with neither answers a 400."""

from http_api.errors import APIError

FIM_TOKENS = (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
              ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))


def fim_prompt(tokenizer, prompt, suffix: str) -> str:
    """The prompt text that asks the model for what goes between prompt and suffix."""
    vocab = tokenizer.hf_tokenizer if tokenizer is not None else None
    tokens = next((t for t in FIM_TOKENS if vocab is not None and all(vocab.token_to_id(x) is not None
                                                                     for x in t)), None)
    if tokens is None:
        raise APIError(400, "suffix asks to fill in the middle, and this model has no fill-in-the-middle "
                            f"tokens ({' or '.join(' '.join(t) for t in FIM_TOKENS)}); drop suffix",
                       param="suffix", code="fim_not_supported")
    if not isinstance(prompt, str):
        raise APIError(400, "suffix needs text prompts (not token ids)", param="prompt")
    prefix, middle_suffix, middle = tokens
    return f"{prefix}{prompt}{middle_suffix}{suffix}{middle}"
