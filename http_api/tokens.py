"""Prompts as token ids for the OpenAI endpoints: chat messages rendered by the model's chat template, and
the /tokenize and /detokenize bodies (vLLM's shapes). `info` is Deployment.model_info's answer."""

from cluster_configs.errors import InvalidRequest
from http_api.chat_template import ChatTemplate
from http_api.errors import APIError, invalid_request
from http_api.protocol import DetokenizeRequest, TokenizeRequest
from http_api.responses import TokenTexts
from scheduling.validation import RequestLimits, check_text_length


def chat_prompt_ids(info: dict, chat_template: ChatTemplate | None, model_name: str, messages: list,
                    tools: list[dict] | None, add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, for_generation: bool = False) -> list[int]:
    """The token ids of messages rendered by the model's chat template (whose own special tokens count:
    none are added unless asked); for_generation: a rendering too long for max_model_len is a 400 (/tokenize
    counts any length)."""
    tokenizer = info["tokenizer"]
    if chat_template is None or tokenizer is None:
        raise APIError(400, f"model {model_name!r} has no chat template (no chat_template.jinja or "
                            "chat_template in tokenizer_config.json, or no tokenizer); use "
                            "/v1/completions with the model's own prompt format, or add a template to "
                            "the model directory",
                       param="messages", code="no_chat_template")
    text = chat_template.render([m.template_message() for m in messages],
                                add_generation_prompt=add_generation_prompt, tools=tools)
    if for_generation:  # a text too long for any prompt is refused before it is tokenized
        limits = RequestLimits(info["vocab_size"], info["max_model_len"])
        try:
            check_text_length(len(text), tokenizer.max_token_chars, limits, prompt_only=False)
        except InvalidRequest as e:
            raise invalid_request(str(e), "messages") from None
    return tokenizer.hf_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def tokenize_body(info: dict, texts: TokenTexts, chat_template: ChatTemplate | None, model_name: str,
                  req: TokenizeRequest) -> dict:
    """count, max_model_len, tokens (and token_strs if asked)."""
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "send a prompt or messages (exactly one)", param="prompt")
    if info["tokenizer"] is None:
        raise APIError(400, f"model {model_name!r} has no tokenizer.json; it takes token ids only",
                       param="prompt")
    if req.messages is not None:
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        ids = chat_prompt_ids(info, chat_template, model_name, req.messages, tools, req.add_generation_prompt,
                              bool(req.add_special_tokens))
    else:
        special = req.add_special_tokens is not False
        ids = info["tokenizer"].hf_tokenizer.encode(req.prompt, add_special_tokens=special).ids
    return {"count": len(ids), "max_model_len": info["max_model_len"], "tokens": ids,
            "token_strs": [texts.text(t) for t in ids] if req.return_token_strs else None}


def detokenize_body(info: dict, model_name: str, req: DetokenizeRequest) -> dict:
    if info["tokenizer"] is None:
        raise APIError(400, f"model {model_name!r} has no tokenizer.json", param="tokens")
    if any(not 0 <= t < info["vocab_size"] for t in req.tokens):
        raise APIError(400, f"tokens must be ids in [0, {info['vocab_size']})", param="tokens")
    return {"prompt": info["tokenizer"].decode(req.tokens)}
