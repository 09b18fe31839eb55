"""Structured outputs through llguidance: a request's StructuredOutputs as a grammar, a matcher per request
that says which tokens may come next, and the step's token masks computed while the model runs.

`grammar_of` is the check (validation.py calls it: an invalid schema, regex, grammar or choice list is an
InvalidRequest naming llguidance's error); `Grammars.matcher` compiles a request's grammar once, against the
engine's tokenizer, into a GrammarMatcher that lives on the request (`req.matcher`). Each step, `MaskWorker`
fills the masks of the constrained requests that sample, in one thread started before the forward and joined
before sampling (llguidance drops the GIL while it computes a mask); the output processor advances the
matcher token by token (`GrammarMatcher.advance`) and finishes the request with "stop" once the grammar is
complete and admits nothing but EOS. EOS is in a mask only where the grammar accepts.

Jump-forward: after a step's tokens, the output processor appends the tokens the grammar forces next
(`GrammarMatcher.forced_tokens`: llguidance's fast-forward tokens, kept while each is the single token its
mask allows) without sampling them; the next step computes them with the request's last token, as a
verification computes accepted drafts. A masked row whose mask allows one token samples that token whatever
the logits, seed or position, so the output equals masked decoding token for token; a fixed-key schema takes
fewer steps. A request that asked for logprobs is not jumped (a forced token has no sampled row to report).

Speculation: a constrained request keeps, of its chain of drafts (of a tree: its best guesses' chain),
the prefix its grammar admits (`GrammarMatcher.admitted`), whichever method drafted it; the mask of its row
after draft j is computed with drafts 0..j consumed, then rolled back (`fill_masks`), so each row is sampled
exactly as plain masked decoding would sample it there.

JSON is compact (no whitespace between tokens, llguidance's whitespace_flexible off): a small model given
flexible whitespace can spend its whole max_tokens on spaces and newlines.
"""

import functools
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from cluster_configs.errors import InvalidRequest
from cluster_configs.structured_outputs import StructuredOutputs
from models.proposers.token_tree import TokenTree

_JSON_OPTIONS = {"whitespace_flexible": False}


def grammar_of(so: StructuredOutputs) -> str:
    """The llguidance grammar of so; InvalidRequest naming the problem when it does not compile."""
    kind = so.kind
    if kind == "regex":
        grammar = LLMatcher.grammar_from_regex(so.regex)
    elif kind == "grammar":
        grammar = LLMatcher.grammar_from_lark(so.grammar)
    elif kind == "choice":
        if not so.choice or not all(so.choice):
            raise InvalidRequest("structured_outputs.choice must list at least one non-empty string",
                                 param="structured_outputs")
        grammar = LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in so.choice))
    else:
        grammar = LLMatcher.grammar_from_json_schema(_schema(so), overrides=_JSON_OPTIONS)
    error = _grammar_error(grammar)
    if error:
        raise InvalidRequest(f"structured_outputs.{kind} is invalid: {error.strip()}",
                             param="structured_outputs")
    return grammar


def _schema(so: StructuredOutputs) -> dict:
    """The JSON Schema of a json or json_object constraint."""
    if so.json_object:
        return {"type": "object"}
    schema = so.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"structured_outputs.json is not valid JSON ({e}); pass a JSON Schema",
                                 param="structured_outputs") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"structured_outputs.json must be a JSON Schema object, got "
                             f"{type(schema).__name__}", param="structured_outputs")
    return schema


@functools.lru_cache(maxsize=256)
def _grammar_error(grammar: str) -> str:
    """llguidance's error for grammar ("" when it compiles); a repeated schema is checked once."""
    return LLMatcher.validate_grammar(grammar)


class GrammarMatcher:
    """One request's constraint state: an llguidance matcher over the tokens the request has output."""

    def __init__(self, tokenizer: LLTokenizer, grammar: str):
        self.eos_token_ids = frozenset(tokenizer.eos_tokens)
        self.matcher = LLMatcher(tokenizer, grammar, log_level=0)
        self._one_row = allocate_token_bitmask(1, tokenizer.vocab_size)  # [1, ceil(V / 32)] int32
        if self.matcher.is_error():  # what only the tokenizer reveals (e.g. a token the vocabulary lacks)
            raise InvalidRequest(f"structured_outputs is invalid: {self.matcher.get_error()}",
                                 param="structured_outputs")

    def admitted(self, drafts: TokenTree) -> TokenTree:
        """Of a chain of drafts, the prefix the grammar admits after the output so far, cut before an EOS (the
        request would end there). A ranked tree (EAGLE's, Medusa's) gives its chain of best guesses (width 1):
        its other nodes would each need their own path's mask; an unranked tree gives nothing."""
        if not drafts.is_chain:
            if drafts.ranks is None:
                return TokenTree.chain(())
            drafts = TokenTree.chain(drafts.narrowed(1).tokens)
        tokens = drafts.tokens[:self.matcher.validate_tokens(list(drafts.tokens))]
        return TokenTree.chain(tokens[:next((j for j, t in enumerate(tokens) if t in self.eos_token_ids),
                                            len(tokens))])

    def fill_masks(self, bitmask: np.ndarray, first_row: int, drafts: Sequence[int]) -> None:
        """bitmask[first_row + j] ([W] int32, bit t: token t allowed) := the tokens that may follow the output
        and drafts[:j], for j = 0..len(drafts) (admitted drafts: consumed in turn, then rolled back)."""
        for j, token in enumerate(drafts):
            fill_next_token_bitmask(self.matcher, bitmask, first_row + j)
            self.matcher.consume_token(token)
        fill_next_token_bitmask(self.matcher, bitmask, first_row + len(drafts))
        self.matcher.rollback(len(drafts))

    def forced_tokens(self, limit: int) -> list[int]:
        """Up to limit tokens the grammar forces next, each the only token allowed after the ones before (EOS
        excluded: the output processor ends the request there); the matcher is left where it was."""
        forced: list[int] = []
        for token in self.matcher.compute_ff_tokens()[:limit]:
            if token in self.eos_token_ids or self._only_allowed() != token:
                break
            self.matcher.consume_token(token)
            forced.append(token)
        if forced:
            self.matcher.rollback(len(forced))
        return forced

    def _only_allowed(self) -> int | None:
        """The one token the grammar allows next, None if it allows several (or none)."""
        fill_next_token_bitmask(self.matcher, self._one_row, 0)
        words = np.flatnonzero(self._one_row[0])
        if len(words) != 1:
            return None
        word = int(self._one_row[0, words[0]]) & 0xFFFFFFFF
        return int(words[0]) * 32 + word.bit_length() - 1 if word & (word - 1) == 0 else None

    def advance(self, token_id: int) -> bool:
        """Consume an output token; -> whether the output is complete (the grammar admits only EOS now).
        A token the grammar rejects (never sampled under its mask) leaves the matcher stopped too."""
        self.matcher.consume_token(token_id)
        return self.matcher.is_stopped()


class Grammars:
    """An engine's grammar compiler: its tokenizer for llguidance, built on the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, eos_token_ids

    @functools.cached_property
    def ll_tokenizer(self) -> LLTokenizer:
        # the model's logits width (the vocabulary may have unused rows past the tokenizer's)
        return LLTokenizer(self.tokenizer.hf_tokenizer.to_str(), n_vocab=self.vocab_size,
                           eos_token=list(self.eos_token_ids) or None)

    def matcher(self, so: StructuredOutputs) -> GrammarMatcher:
        if self.tokenizer is None:
            raise InvalidRequest("structured_outputs needs the model's tokenizer.json, which this model "
                                 "directory lacks", param="structured_outputs")
        return GrammarMatcher(self.ll_tokenizer, grammar_of(so))


@dataclass(frozen=True)
class StepMasks:
    """A step's grammar masks and what they cost."""
    masks: dict[int, np.ndarray]  # index in plan.scheduled -> [1 + num drafts, V] bool
    num_rows: int  # masked rows (sampled under a grammar)
    seconds: float  # computing them, in the mask thread
    wait_seconds: float  # the sampler's wait for them after the forward: the part the forward did not hide


class MaskWorker:
    """Computes a step's token masks in one thread while the model runs: `start` before the forward,
    `result` before sampling."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="numaserve-masks")

    def start(self, plan) -> Future | None:
        """Masks for the plan's constrained requests that sample this step (None: no such request)."""
        constrained = [(i, s.request.matcher, s.draft_token_ids) for i, s in enumerate(plan.scheduled)
                       if s.request.matcher is not None
                       and s.request.num_computed_tokens + s.num_base_tokens == s.request.num_tokens]
        return self.pool.submit(_timed_token_masks, constrained, self.vocab_size) if constrained else None

    @staticmethod
    def result(future: Future | None) -> StepMasks | None:
        """The started masks, waiting for them if they are not done."""
        if future is None:
            return None
        start = time.perf_counter()
        masks, seconds = future.result()
        return StepMasks(masks, sum(len(m) for m in masks.values()), seconds, time.perf_counter() - start)


def _timed_token_masks(constrained, vocab_size: int) -> tuple[dict[int, np.ndarray], float]:
    start = time.perf_counter()
    masks = token_masks(constrained, vocab_size)
    return masks, time.perf_counter() - start


def token_masks(constrained: list[tuple[int, GrammarMatcher, Sequence[int]]], vocab_size: int
                ) -> dict[int, np.ndarray]:
    """(key, matcher, its drafts) -> key: [1 + len(drafts), vocab_size] bool, the tokens the matcher allows
    next and after each draft."""
    firsts = np.cumsum([0] + [1 + len(drafts) for _, _, drafts in constrained])
    bitmask = allocate_token_bitmask(int(firsts[-1]), vocab_size)  # [rows, ceil(V / 32)] int32
    for first, (_, matcher, drafts) in zip(firsts, constrained):
        matcher.fill_masks(bitmask, int(first), drafts)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab_size, bitorder="little").view(bool)
    return {key: bits[first:end] for first, end, (key, *_) in zip(firsts, firsts[1:], constrained)}
