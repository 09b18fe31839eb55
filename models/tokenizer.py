"""Tokenizer of a model directory (tokenizer.json via the tokenizers library) and incremental decoding."""

from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from cluster_configs.errors import CheckpointError

_PREFIX_TOKENS = 5  # prompt tokens decoded before the output so word boundaries come out right


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer):
        self._tok = tokenizer
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @classmethod
    def from_dir(cls, model_dir: Path) -> "Tokenizer | None":
        """The tokenizer.json of a model directory; None if it has none (token-id prompts only)."""
        path = model_dir / "tokenizer.json"
        if not path.exists():
            return None
        try:
            return cls(HFTokenizer.from_file(str(path)))
        except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
            raise CheckpointError(f"{path}: cannot be read by the tokenizers library ({e}); save the "
                                  "tokenizer with tokenizer.save_pretrained(dir)") from None

    @property
    def hf_tokenizer(self) -> HFTokenizer:
        return self._tok

    @cached_property
    def frames(self) -> tuple[bool, bool]:
        """Whether encoding prepends, and whether it appends, a token (the post-processor's BOS, EOS)."""
        framed, plain = self._tok.encode("a").ids, self._tok.encode("a", add_special_tokens=False).ids
        return framed[:1] != plain[:1], framed[-1:] != plain[-1:]

    def stream(self, texts: list[str], eos: int | None) -> np.ndarray:
        """The texts encoded one by one, each as the tokenizer frames it and followed by eos (if any), in one
        int64 stream."""
        tail = [] if eos is None else [eos]
        return np.array([t for e in self._tok.encode_batch(texts) for t in [*e.ids, *tail]], np.int64)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def max_token_chars(self) -> int:
        """The longest token's length in characters (as the vocabulary spells it)."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids  # with the special tokens its post-processor declares (e.g. BOS)

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.token_ids = list(prompt_token_ids[-_PREFIX_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)

    def add(self, new_token_ids: list[int]) -> str:
        self.token_ids.extend(new_token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = decode(self.token_ids[self.prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for the next token
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]
