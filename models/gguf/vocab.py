"""GGUF vocabularies: a Tokenizer from a file's tokenizer.ggml.* metadata (gpt2 byte-level BPE, llama
SentencePiece), and the byte-level BPE vocabulary written on export (from a tokenizer, or synthetic)."""

import itertools
import json
from dataclasses import dataclass
from pathlib import Path

from gguf import TokenType
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from cluster_configs.errors import CheckpointError
from models.gguf.format import metadata_key
from models.model_spec import ModelSpec
from models.tokenizer import Tokenizer

# tokenizer.ggml.pre -> the split regex before byte-level mapping (None: GPT-2's, built into ByteLevel)
_PRE_REGEX = {
    "gpt-2": None,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


# ---- tokenizer -------------------------------------------------------------------------------------------

def tokenizer_from_metadata(path: Path, metadata: dict) -> Tokenizer | None:
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return None  # token-id prompts only, as a model directory without tokenizer.json
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: tokenizer.ggml.model={model!r} is not supported; numaserve reads "
                              "byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies; serve the "
                              "Hugging Face directory (with its tokenizer.json) instead")
    tokens = metadata_key(path, metadata, "tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    tok = (_bpe_tokenizer(path, metadata, tokens) if model == "gpt2"
           else _spm_tokenizer(path, metadata, tokens))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types)
                    if k == TokenType.USER_DEFINED])
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    # llama.cpp's defaults
    add_bos = bos is not None and metadata.get("tokenizer.ggml.add_bos_token", model == "llama")
    add_eos = eos is not None and metadata.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        added = [bos] * add_bos + [eos] * add_eos
        tok.post_processor = processors.TemplateProcessing(
            single=[tokens[bos]] * add_bos + ["$A"] + [tokens[eos]] * add_eos,
            special_tokens=[(tokens[i], i) for i in added])
    return Tokenizer(tok)


def _bpe_tokenizer(path: Path, metadata: dict, tokens: list[str]) -> HFTokenizer:
    """Byte-level BPE: the split regex of tokenizer.ggml.pre, bytes mapped to symbols, ranked merges."""
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in _PRE_REGEX:
        raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; numaserve reproduces "
                              f"the {', '.join(map(repr, _PRE_REGEX))} pre-tokenizers; serve the Hugging "
                              "Face directory (with its tokenizer.json) instead")
    merges = [tuple(m.split(" ", 1)) for m in metadata_key(path, metadata, "tokenizer.ggml.merges")]
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges,
                                 ignore_merges=pre == "llama-bpe",
                                 unk_token=None if unk is None else tokens[unk]))
    regex = _PRE_REGEX[pre]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if regex is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(path: Path, metadata: dict, tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it (and Hugging Face's LlamaConverter builds it): spaces as U+2581,
    repeatedly merge the adjacent pair whose union has the highest score, unknown characters as <0xXX>
    bytes."""
    scores = metadata_key(path, metadata, "tokenizer.ggml.scores")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = sorted(((t[:k], t[k:], i) for t, i in vocab.items() for k in range(1, len(t))
                     if t[:k] in vocab and t[k:] in vocab),
                    key=lambda m: (-scores[m[2]], m[2], vocab[m[0]]))  # best score first
    unk = metadata.get("tokenizer.ggml.unknown_token_id", 0)
    tok = HFTokenizer(models.BPE(vocab, [m[:2] for m in merges], unk_token=tokens[unk], byte_fallback=True,
                                 fuse_unk=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    replace = normalizers.Replace(" ", "\u2581")
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), replace]) if prefix else replace
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    return tok


# ---- export vocabulary -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class GGUFVocab:
    """What llama.cpp needs of a byte-level BPE tokenizer."""

    tokens: list[str]
    types: list[int]
    merges: list[str]  # "left right"
    pre: str
    bos: int | None
    eos: int | None
    unk: int | None
    add_bos: bool
    add_eos: bool


def _pre_name(tok_json: dict) -> str | None:
    pre = tok_json.get("pre_tokenizer") or {}
    if tok_json.get("normalizer") is not None:
        return None
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space"):
        return "gpt-2"
    steps = pre.get("pretokenizers", [])
    if (pre.get("type") == "Sequence" and len(steps) == 2 and steps[0].get("type") == "Split"
            and steps[0].get("pattern", {}).get("Regex") == _PRE_REGEX["llama-bpe"]
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex", True)):
        return "llama-bpe"
    return None


def vocab_from_tokenizer(spec: ModelSpec, tokenizer: Tokenizer) -> GGUFVocab:
    hf = tokenizer.hf_tokenizer
    tok_json = json.loads(hf.to_str())
    model, pre = tok_json["model"], _pre_name(tok_json)
    if model["type"] != "BPE" or model.get("byte_fallback") or pre is None:
        raise CheckpointError("the tokenizer is not a byte-level BPE with a GPT-2 or Llama-3 pre-tokenizer, "
                              "the kinds numaserve writes to GGUF; convert this model with "
                              "convert_hf_to_gguf.py")
    added = {t["id"]: t for t in tok_json["added_tokens"]}
    by_id = {i: t for t, i in model["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if max(by_id) >= spec.vocab_size:
        raise CheckpointError(f"the tokenizer has token id {max(by_id)} but the model only {spec.vocab_size} "
                              "embedding rows; tokenizer and weights do not match")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(spec.vocab_size)]
    types = [TokenType.UNUSED if i not in by_id else TokenType.NORMAL if i not in added
             else TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED
             for i in range(spec.vocab_size)]
    return GGUFVocab(tokens=tokens, types=[int(t) for t in types],
                     merges=[m if isinstance(m, str) else " ".join(m) for m in model["merges"]], pre=pre,
                     bos=spec.bos_token_id, eos=spec.eos_token_ids[0] if spec.eos_token_ids else None,
                     unk=model["vocab"].get(model.get("unk_token")),
                     add_bos=tokenizer.frames[0], add_eos=tokenizer.frames[1])


def synthetic_vocab(spec: ModelSpec) -> GGUFVocab:
    """For a model without a tokenizer: <s> / </s> at the spec's ids, the 256 byte-level symbols, then
    merged symbol sequences up to vocab_size, so llama.cpp loads a valid BPE vocabulary."""
    bos = spec.bos_token_id if spec.bos_token_id is not None else 1
    eos = spec.eos_token_ids[0] if spec.eos_token_ids else 2
    specials = {bos: "<s>", eos: "</s>"}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if spec.vocab_size < len(alphabet) + len(specials) + 1:
        raise CheckpointError(f"vocab_size={spec.vocab_size} is too small for a byte-level vocabulary; "
                              "export the model with its tokenizer")
    longer = (p for k in itertools.count(2) for p in itertools.product(alphabet, repeat=k))
    symbols = itertools.chain(([a] for a in alphabet), longer)
    tokens, types, merges = [], [], []
    for i in range(spec.vocab_size):
        if i in specials:
            tokens.append(specials[i])
            types.append(TokenType.CONTROL)
            continue
        parts = next(symbols)
        tokens.append("".join(parts))
        types.append(TokenType.NORMAL)
        if len(parts) > 1:
            merges.append("".join(parts[:-1]) + " " + parts[-1])
    return GGUFVocab(tokens=tokens, types=[int(t) for t in types], merges=merges, pre="gpt-2", bos=bos,
                     eos=eos, unk=None, add_bos=False, add_eos=False)
