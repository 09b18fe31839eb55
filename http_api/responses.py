"""The OpenAI response shapes: completion and chat choices, their logprobs, usage, and stream chunks."""

import functools
import re
import time
import uuid
from dataclasses import dataclass, field

from scheduling.outputs import RequestOutput

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM's floor too


@dataclass
class ChoiceState:
    """One choice of a response as its outputs arrive: what has been generated and said so far."""

    index: int
    prompt_ids: list[int]
    prompt_text: str | None = None  # completions with echo: the prompt before the first text
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    num_outputs: int = 0
    # params.prompt_logprobs: None, then a row per prompt token
    prompt_logprobs: list[dict[int, float] | None] | None = None

    def add(self, out: RequestOutput) -> None:
        self.num_outputs += 1
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.token_ids += out.token_ids
        self.text += out.text
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + out.logprobs
        self.finish_reason = out.finish_reason


class TokenTexts:
    """A token's bytes and text as logprobs show them, read from its vocabulary entry (decoding one token
    alone would drop a SentencePiece word's leading space and turn a byte-level piece of a character into
    U+FFFD): byte-level BPE symbols mapped back to bytes, <0xNN> byte-fallback tokens as that byte, else the
    piece with "▁" as a space. A model without a tokenizer shows token_id:N."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        if tokenizer is not None:
            from tokenizers.decoders import ByteLevel

            self.byte_level = isinstance(tokenizer.hf_tokenizer.decoder, ByteLevel)
        self.bytes = functools.lru_cache(maxsize=65536)(self._bytes)

    def text(self, token_id: int) -> str:
        return self.bytes(token_id).decode(errors="replace")

    def _bytes(self, token_id: int) -> bytes:
        if self.tokenizer is None:
            return f"token_id:{token_id}".encode()
        piece = self.tokenizer.hf_tokenizer.id_to_token(token_id) or ""
        if self.byte_level and all(ch in BYTE_DECODER for ch in piece):
            return bytes(BYTE_DECODER[ch] for ch in piece)
        if re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (tokenizers' ByteLevel): symbol -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


BYTE_DECODER = _byte_decoder()


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def completion_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]],
                        text_offset: int) -> dict:
    """The legacy completions shape; top_logprobs holds the k most likely and the sampled token, by text."""
    tokens = [texts.text(t) for t in token_ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {"tokens": tokens, "token_logprobs": [_logprob(lp[t]) for t, lp in zip(token_ids, logprobs)],
            "top_logprobs": [_top_by_text(texts, lp) for lp in logprobs], "text_offset": offsets}


def echo_logprobs(texts: TokenTexts, prompt_ids: list[int], prompt_logprobs: list[dict[int, float] | None],
                  generated: dict | None) -> dict:
    """OpenAI's completions logprobs with echo: the prompt's tokens first (the first one's logprob and
    top_logprobs null: nothing precedes it), then the generated ones' (generated: completion_logprobs of
    them, with text offsets after the prompt's text)."""
    scored = completion_logprobs(texts, prompt_ids[1:], prompt_logprobs[1:], len(texts.text(prompt_ids[0])))
    out = {"tokens": [texts.text(prompt_ids[0]), *scored["tokens"]],
           "token_logprobs": [None, *scored["token_logprobs"]],
           "top_logprobs": [None, *scored["top_logprobs"]], "text_offset": [0, *scored["text_offset"]]}
    if generated is not None:
        for key in out:
            out[key] += generated[key]
    return out


def vllm_prompt_logprobs(texts: TokenTexts, prompt_logprobs: list[dict[int, float] | None], k: int) -> list:
    """vLLM's prompt_logprobs: per prompt token (None for the first), token id -> logprob, rank and decoded
    token. A row lists the k most likely first (ranks 1..k), then the prompt's token when it is not among
    them (its rank null: not computed)."""
    return [None if r is None else {
        str(t): {"logprob": _logprob(v), "rank": i + 1 if i < k else None, "decoded_token": texts.text(t)}
        for i, (t, v) in enumerate(r.items())} for r in prompt_logprobs]


def _top_by_text(texts: TokenTexts, row: dict[int, float]) -> dict[str, float]:
    """A row keyed by token text; of two tokens with the same text (a byte-fallback token and a piece, say)
    the likelier one stands."""
    top: dict[str, float] = {}
    for token_id, value in row.items():
        text = texts.text(token_id)
        top[text] = max(top.get(text, MIN_LOGPROB), _logprob(value))
    return top


def chat_logprobs(texts: TokenTexts, token_ids: list[int], logprobs: list[dict[int, float]], k: int) -> dict:
    """The chat shape: each token with its bytes and the k most likely (a row lists those first, in order)."""
    def entry(token_id: int, value: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _logprob(value),
                "bytes": list(texts.bytes(token_id))}

    return {"content": [entry(t, lp[t]) | {"top_logprobs": [entry(i, v) for i, v in list(lp.items())[:k]]}
                        for t, lp in zip(token_ids, logprobs)]}


def usage(choices: list[ChoiceState], n: int) -> dict:
    """Prompt tokens once per prompt (its n choices share it), completion tokens of every choice."""
    prompt_tokens = sum(len(c.prompt_ids) for c in choices if c.index % n == 0)
    completion_tokens = sum(len(c.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass(frozen=True)
class ResponseHeader:
    """What every response object and stream chunk of one request repeats."""

    id: str
    object: str
    model: str
    system_fingerprint: str
    created: int = field(default_factory=lambda: int(time.time()))

    @classmethod
    def new(cls, prefix: str, object_name: str, model: str, fingerprint: str) -> "ResponseHeader":
        return cls(f"{prefix}-{uuid.uuid4().hex}", object_name, model, fingerprint)

    def body(self, choices: list[dict], **extra) -> dict:
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices} | extra


def sse_event(data: str) -> bytes:
    """One server-sent event of a stream: `data: <data>` and a blank line. data is one line (JSON text, whose
    line breaks are escaped, or [DONE]). Framed here, not by sse-starlette (which would split the data on line
    breaks and join it again through a StringIO for every chunk), with the same bytes."""
    return f"data: {data}\n\n".encode()
