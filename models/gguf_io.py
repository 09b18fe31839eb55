"""GGUF interop: load llama-architecture GGUF files, export a loaded model, so numaserve and llama.cpp run
identical weights.

Quantized tensors map byte for byte: a GGUF Q8_0 block is (fp16 d, 32 x int8), a Q4_0 block (fp16 d, 16 bytes,
element j in the low nibble and j + 16 in the high nibble of byte j); a WeightMatrix holds the same values
split into `scales` and `data`. llama.cpp's rope rotates adjacent pairs where Hugging Face's rotates i with
i + head_dim / 2, so convert_hf_to_gguf.py interleaves the two halves of every head of attn_q / attn_k: we
undo that on load and redo it on export.
"""

import itertools
import json
import math
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    TokenType,
)
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tqdm import tqdm

from cluster_configs.errors import CheckpointError
from memory.weights import WeightMatrix
from models.checkpoint import lm_head_dtype
from models.linear import dequantize
from models.loader import load_model
from models.rope import rope_inv_freq
from models.spec import ModelSpec
from models.tokenizer import Tokenizer

GT = GGMLQuantizationType
ARCH = "llama"
ROPE_SCALING_KEY = "numaserve.rope_scaling"  # Hugging Face's rope_scaling as JSON: exact where rope_freqs rounds
_AUTO = {GT.F32: "float32", GT.F16: "bfloat16", GT.BF16: "bfloat16", GT.Q8_0: "q8_0", GT.Q4_0: "q4_0"}
_GGML_TYPE = {"float32": GT.F32, "bfloat16": GT.BF16, "q8_0": GT.Q8_0, "q4_0": GT.Q4_0}
_PRECISION = ("q4_0", "q8_0", "bfloat16", "float32")  # least to most precise
_FILE_TYPE = {"float32": LlamaFileType.ALL_F32, "bfloat16": LlamaFileType.MOSTLY_BF16,
              "q8_0": LlamaFileType.MOSTLY_Q8_0, "q4_0": LlamaFileType.MOSTLY_Q4_0}
# tokenizer.ggml.pre -> the split regex before byte-level mapping (None: GPT-2's, built into ByteLevel)
_PRE_REGEX = {
    "gpt-2": None,
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}
_REQUIRED = object()


# ---- reading ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredTensor:
    """A tensor copied out of the file, in the file's format: a WeightMatrix (F32, BF16, Q8_0, Q4_0) or a
    float16 array (F16); 1-D tensors as one row."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [N, K] or [N]
    value: WeightMatrix | np.ndarray


def read_gguf(path: Path) -> tuple[dict, dict[str, StoredTensor]]:
    """-> (metadata, tensors), all copied into process memory: the file mapping is gone on return (the VM
    reclaims idle file pages, so a long-lived mmap would re-read the disk in the middle of serving)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; pass the path of a .gguf file")
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, OverflowError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e}); if it was copied or downloaded, check "
                              "that it is complete; write one with numaserve's export_gguf or convert_hf_to_gguf.py") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: a big-endian GGUF file; convert it for little-endian hosts")
    metadata = {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    tensors = {t.name: _copy_tensor(path, t) for t in reader.tensors}
    return metadata, tensors


def _copy_tensor(path: Path, t) -> StoredTensor:
    kind = t.tensor_type
    if kind not in _AUTO:
        raise CheckpointError(
            f"{path}: tensor {t.name!r} is {kind.name}, which numaserve does not load (it loads F32, F16, BF16, "
            "Q8_0 and Q4_0); requantize with `llama-quantize --pure model-f16.gguf out.gguf Q8_0` (or Q4_0), "
            "or load the F16 GGUF / Hugging Face directory with weight_dtype='q4_0'")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = t.data.reshape(-1, t.data.shape[-1])  # F32, F16: [N, K]; BF16, Q8_0, Q4_0: uint8 [N, bytes per row]
    if kind == GT.F16:
        return StoredTensor(kind, shape, np.array(data, np.float16))
    if kind == GT.F32:
        return StoredTensor(kind, shape, WeightMatrix("float32", np.array(data, np.float32)))
    if kind == GT.BF16:
        return StoredTensor(kind, shape, WeightMatrix("bfloat16", np.array(data).view(np.uint16)))
    n = data.shape[0]
    blocks = data.reshape(n, -1, GGML_QUANT_SIZES[kind][1])  # [N, K // 32, 2 + 32 | 2 + 16]
    scales = np.ascontiguousarray(blocks[:, :, :2]).view(np.uint16).reshape(n, -1)  # fp16 bits [N, K // 32]
    qs = np.ascontiguousarray(blocks[:, :, 2:]).reshape(n, -1)  # Q8_0: [N, K]; Q4_0: [N, K // 2]
    return StoredTensor(kind, shape, WeightMatrix(_AUTO[kind], qs.view(np.int8) if kind == GT.Q8_0 else qs, scales))


def _key(path: Path, metadata: dict, key: str, default=_REQUIRED):
    if key in metadata:
        return metadata[key]
    if default is _REQUIRED:
        raise CheckpointError(f"{path}: metadata key {key!r} is missing; re-convert the model with a recent "
                              "convert_hf_to_gguf.py or numaserve's export_gguf")
    return default


def _f32(value: float) -> float:
    """A float32 metadata value as the short decimal configs use: float32(1e-5) -> 1e-5."""
    return float(str(np.float32(value)))


# ---- spec ------------------------------------------------------------------------------------------------

def _spec(path: Path, metadata: dict, tensors: dict[str, StoredTensor]) -> ModelSpec:
    arch = metadata.get("general.architecture")
    if arch != ARCH:
        raise CheckpointError(f"{path}: general.architecture={arch!r} is not supported; numaserve loads 'llama' "
                              "GGUF files (Llama and Llama-shaped models); serve the Hugging Face directory instead")

    def key(name: str, default=_REQUIRED):
        return _key(path, metadata, f"{ARCH}.{name}", default)

    if key("expert_count", 0):
        raise CheckpointError(f"{path}: {ARCH}.expert_count={key('expert_count')}: mixture-of-experts models "
                              "are not supported; serve a dense Llama-family model")
    hidden, num_heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = int(key("attention.key_length", hidden // num_heads))
    for name in ("attention.value_length", "rope.dimension_count"):
        if key(name, head_dim) != head_dim:
            raise CheckpointError(f"{path}: {ARCH}.{name}={key(name)} differs from the head size {head_dim}; "
                                  "partial rotary and split key/value sizes are not supported")
    tokens = metadata.get("tokenizer.ggml.tokens")
    embd = tensors.get("token_embd.weight")
    vocab_size = key("vocab_size", len(tokens) if tokens else embd.shape[0] if embd else _REQUIRED)
    rope_theta = _f32(key("rope.freq_base", 10000.0))
    eos = (metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom"))
    return ModelSpec(
        architecture="LlamaForCausalLM",
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(key("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(path, metadata, tensors, rope_theta, head_dim),
        max_position_embeddings=int(key("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        qkv_bias=False,
        layer_windows=(0,) * int(key("block_count")),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _rope_scaling(path: Path, metadata: dict, tensors: dict, rope_theta: float, head_dim: int) -> dict | None:
    freqs = tensors.pop("rope_freqs.weight", None)
    if ROPE_SCALING_KEY in metadata:
        return json.loads(metadata[ROPE_SCALING_KEY])
    kind = metadata.get(f"{ARCH}.rope.scaling.type", "linear")  # llama.cpp's default
    factor = _f32(metadata.get(f"{ARCH}.rope.scaling.factor", 0.0))
    if kind not in ("none", "linear"):
        raise CheckpointError(f"{path}: {ARCH}.rope.scaling.type={kind!r} is not supported; numaserve applies "
                              "linear and llama3 (rope_freqs.weight) scaling")
    linear = kind == "linear" and factor not in (0.0, 1.0)
    if freqs is not None and linear:
        raise CheckpointError(f"{path}: both rope_freqs.weight and linear rope scaling; expected one of them")
    if linear:
        return {"rope_type": "linear", "factor": factor}
    if freqs is None:
        return None
    if freqs.shape != (head_dim // 2,):
        raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' has shape {freqs.shape}, expected "
                              f"({head_dim // 2},): one divisor per rotary frequency")
    return llama3_scaling_from_factors(_vector(freqs), rope_theta, head_dim)


def llama3_scaling_from_factors(factors: np.ndarray, rope_theta: float, head_dim: int) -> dict | None:
    """Hugging Face's llama3 rope scaling from llama.cpp's per-frequency divisors (rope_freqs.weight).

    With u = L * v (L the original context, v = 1 / wavelength) the divisor is `factor` where u < low, 1 where
    u > high, and 1 / ((1 - s) / factor + s) on the ramp between, s = (u - low) / (high - low). Only ratios are
    determined: low_freq_factor is taken as 1."""
    r = factors.astype(np.float64)
    factor = float(r.max())
    if factor <= 1.0:
        return None
    v = 1.0 / rope_theta ** (np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)  # ascending frequency order
    low, high = np.isclose(r, factor), np.isclose(r, 1.0)
    ramp = ~low & ~high
    if not high.any() and not ramp.any():
        return {"rope_type": "linear", "factor": _f32(factor)}
    s = (1 / r[ramp] - 1 / factor) / (1 - 1 / factor)
    if ramp.sum() >= 2:
        slope, intercept = np.polyfit(v[ramp], s, 1)  # s = (L v - 1) / (high - 1)
        original, high_factor = round(-slope / intercept), float(f"{1 - 1 / intercept:.6g}")
    else:
        original, high_factor = _llama3_bounds(v[low].max(), v[high].min() if high.any() else None, v[ramp], s)
    return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": 1.0,
            "high_freq_factor": high_factor, "original_max_position_embeddings": original}


def _llama3_bounds(v_low: float, v_high: float | None, v_ramp: np.ndarray, s: np.ndarray) -> tuple[float, float]:
    """(L, high) with at most one frequency on the ramp: every frequency on its side, the ramp one exact."""
    original = 1 / v_low  # the highest scaled frequency sits on the low boundary...
    if not len(v_ramp):
        return float(original), float(original * v_high)
    vm, sm = v_ramp[0], s[0]
    if v_high is not None and vm - sm * v_high > 0:  # ...unless that would put the high boundary above v_high
        original = min(original, (1 - sm) / (vm - sm * v_high))
    return float(original), float(1 + (original * vm - 1) / sm)


def rope_freq_factors(spec: ModelSpec) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for a llama3-scaled spec: [head_dim // 2] f32 divisors."""
    base, _ = rope_inv_freq(replace(spec, rope_scaling=None))
    scaled, _ = rope_inv_freq(spec)
    return (base.astype(np.float64) / scaled).astype(np.float32)


def _rope_type(spec: ModelSpec) -> str:
    scaling = spec.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default"))


def rope_row_order(num_heads: int, head_dim: int) -> np.ndarray:
    """GGUF row i of attn_q / attn_k is Hugging Face row order[i] (convert_hf_to_gguf's permute)."""
    return np.arange(num_heads * head_dim).reshape(num_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)


# ---- weights ---------------------------------------------------------------------------------------------

def _pop(path: Path, tensors: dict, name: str, shape: tuple[int, ...]) -> StoredTensor:
    t = tensors.pop(name, None)
    if t is None:
        raise CheckpointError(f"{path}: tensor {name!r} is missing (expected shape {shape}); the file is "
                              "incomplete or not a llama model with these llama.* metadata")
    if t.shape != shape:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {t.shape}, expected {shape} from the llama.* "
                              "metadata; the weights and the metadata do not match")
    return t


def _to_float(t: StoredTensor) -> np.ndarray:
    return t.value.astype(np.float32) if isinstance(t.value, np.ndarray) else dequantize(t.value)


def _vector(t: StoredTensor) -> np.ndarray:
    return np.ascontiguousarray(_to_float(t).reshape(-1))  # [N] f32


def _served(parts: list[StoredTensor], weight_dtype: str, role_dtype: str,
            rows: np.ndarray | None = None) -> WeightMatrix:
    """Parts stacked by rows in one served format: the file's bytes when it already stores that format."""
    if weight_dtype == "auto":
        dtype = max((_AUTO[p.ggml_type] for p in parts), key=_PRECISION.index)
    else:
        stored = {_AUTO[p.ggml_type] if p.ggml_type != GT.F16 else "float16" for p in parts}
        dtype = weight_dtype if stored == {weight_dtype} else role_dtype
    mats = [p.value if isinstance(p.value, WeightMatrix) and p.value.dtype == dtype
            else WeightMatrix.from_float(_to_float(p), dtype) for p in parts]
    if len(mats) > 1:
        scales = None if mats[0].scales is None else np.concatenate([m.scales for m in mats])
        mats = [WeightMatrix(mats[0].dtype, np.concatenate([m.data for m in mats]), scales)]
    return mats[0] if rows is None else _take_rows(mats[0], rows)


def _take_rows(w: WeightMatrix, rows: np.ndarray) -> WeightMatrix:
    return WeightMatrix(w.dtype, w.data[rows], None if w.scales is None else w.scales[rows])


def _weights(path: Path, spec: ModelSpec, tensors: dict, weight_dtype: str) -> dict:
    h, q, kv, inter, D = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim

    def pop(name, shape):
        return _pop(path, tensors, name, shape)

    head_dtype = lm_head_dtype(weight_dtype)
    embed = _served([pop("token_embd.weight", (spec.vocab_size, h))], weight_dtype,
                    head_dtype if spec.tie_word_embeddings else weight_dtype)
    weights = {
        "embed": embed,
        "norm": _vector(pop("output_norm.weight", (h,))),
        "lm_head": embed if spec.tie_word_embeddings else _served(
            [pop("output.weight", (spec.vocab_size, h))], weight_dtype, head_dtype),
        "layers": [],
    }
    qkv_rows = np.concatenate([np.argsort(rope_row_order(spec.num_heads, D)),
                               q + np.argsort(rope_row_order(spec.num_kv_heads, D)), np.arange(q + kv, q + 2 * kv)])
    for i in tqdm(range(spec.num_layers), desc=f"loading {path.name}", disable=not sys.stderr.isatty(), leave=False):
        p = f"blk.{i}."
        qkv = [pop(p + "attn_q.weight", (q, h)), pop(p + "attn_k.weight", (kv, h)), pop(p + "attn_v.weight", (kv, h))]
        weights["layers"].append({
            "input_norm": _vector(pop(p + "attn_norm.weight", (h,))),
            "post_norm": _vector(pop(p + "ffn_norm.weight", (h,))),
            "qkv": _served(qkv, weight_dtype, weight_dtype, qkv_rows),
            "o": _served([pop(p + "attn_output.weight", (h, q))], weight_dtype, weight_dtype),
            "gate_up": _served([pop(p + "ffn_gate.weight", (inter, h)), pop(p + "ffn_up.weight", (inter, h))],
                               weight_dtype, weight_dtype),
            "down": _served([pop(p + "ffn_down.weight", (h, inter))], weight_dtype, weight_dtype),
            "qkv_bias": None,
        })
    if tensors:
        raise CheckpointError(f"{path}: tensors {sorted(tensors)[:4]} are not part of a llama model as numaserve "
                              "runs it (no biases, no extra layers); serve the Hugging Face directory instead")
    return weights


def load_gguf(path: str | Path, weight_dtype: str) -> tuple[ModelSpec, dict, Tokenizer | None]:
    """-> (spec, weights, tokenizer) like the Hugging Face loader. weight_dtype "auto" keeps the file's
    types (F16 and BF16 serve as bfloat16); quantized tensors already in the wanted format keep their bytes."""
    path = Path(path)
    metadata, tensors = read_gguf(path)
    spec = _spec(path, metadata, tensors)
    tokenizer = _tokenizer(path, metadata)
    return spec, _weights(path, spec, tensors, weight_dtype), tokenizer


# ---- tokenizer -------------------------------------------------------------------------------------------

def _tokenizer(path: Path, metadata: dict) -> Tokenizer | None:
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        return None  # token-id prompts only, as a model directory without tokenizer.json
    if model not in ("gpt2", "llama"):
        raise CheckpointError(f"{path}: tokenizer.ggml.model={model!r} is not supported; numaserve reads byte-level "
                              "BPE ('gpt2') and SentencePiece ('llama') vocabularies; serve the Hugging Face "
                              "directory (with its tokenizer.json) instead")
    tokens = _key(path, metadata, "tokenizer.ggml.tokens")
    types = metadata.get("tokenizer.ggml.token_type") or [TokenType.NORMAL] * len(tokens)
    tok = _bpe_tokenizer(path, metadata, tokens) if model == "gpt2" else _spm_tokenizer(path, metadata, tokens)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == TokenType.CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED])
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    add_bos = bos is not None and metadata.get("tokenizer.ggml.add_bos_token", model == "llama")  # llama.cpp's
    add_eos = eos is not None and metadata.get("tokenizer.ggml.add_eos_token", False)  # defaults
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
        raise CheckpointError(f"{path}: tokenizer.ggml.pre={pre!r} is not supported; numaserve reproduces the "
                              f"{', '.join(map(repr, _PRE_REGEX))} pre-tokenizers; serve the Hugging Face directory "
                              "(with its tokenizer.json) instead")
    merges = [tuple(m.split(" ", 1)) for m in _key(path, metadata, "tokenizer.ggml.merges")]
    unk = metadata.get("tokenizer.ggml.unknown_token_id")
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=pre == "llama-bpe",
                                 unk_token=None if unk is None else tokens[unk]))
    regex = _PRE_REGEX[pre]
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if regex is None else \
        pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), "isolated"),
                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _spm_tokenizer(path: Path, metadata: dict, tokens: list[str]) -> HFTokenizer:
    """SentencePiece BPE as llama.cpp runs it (and Hugging Face's LlamaConverter builds it): spaces as U+2581,
    repeatedly merge the adjacent pair whose union has the highest score, unknown characters as <0xXX> bytes."""
    scores = _key(path, metadata, "tokenizer.ggml.scores")
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
        raise CheckpointError("the tokenizer is not a byte-level BPE with a GPT-2 or Llama-3 pre-tokenizer, the "
                              "kinds numaserve writes to GGUF; convert this model with convert_hf_to_gguf.py")
    added = {t["id"]: t for t in tok_json["added_tokens"]}
    by_id = {i: t for t, i in model["vocab"].items()} | {i: t["content"] for i, t in added.items()}
    if max(by_id) >= spec.vocab_size:
        raise CheckpointError(f"the tokenizer has token id {max(by_id)} but the model only {spec.vocab_size} "
                              "embedding rows; tokenizer and weights do not match")
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(spec.vocab_size)]
    types = [TokenType.UNUSED if i not in by_id else TokenType.NORMAL if i not in added
             else TokenType.CONTROL if added[i]["special"] else TokenType.USER_DEFINED for i in range(spec.vocab_size)]
    with_special, plain = hf.encode("a").ids, hf.encode("a", add_special_tokens=False).ids  # the post-processor
    return GGUFVocab(tokens=tokens, types=[int(t) for t in types],
                     merges=[m if isinstance(m, str) else " ".join(m) for m in model["merges"]], pre=pre,
                     bos=spec.bos_token_id, eos=spec.eos_token_ids[0] if spec.eos_token_ids else None,
                     unk=model["vocab"].get(model.get("unk_token")),
                     add_bos=with_special[:1] != plain[:1], add_eos=with_special[-1:] != plain[-1:])


def synthetic_vocab(spec: ModelSpec) -> GGUFVocab:
    """For a model without a tokenizer: <s> / </s> at the spec's ids, the 256 byte-level symbols, then
    merged symbol sequences up to vocab_size, so llama.cpp loads a valid BPE vocabulary."""
    bos = spec.bos_token_id if spec.bos_token_id is not None else 1
    eos = spec.eos_token_ids[0] if spec.eos_token_ids else 2
    specials = {bos: "<s>", eos: "</s>"}
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if spec.vocab_size < len(alphabet) + len(specials) + 1:
        raise CheckpointError(f"vocab_size={spec.vocab_size} is too small for a byte-level vocabulary; export "
                              "the model with its tokenizer")
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
    return GGUFVocab(tokens=tokens, types=[int(t) for t in types], merges=merges, pre="gpt-2", bos=bos, eos=eos,
                     unk=None, add_bos=False, add_eos=False)


# ---- export ----------------------------------------------------------------------------------------------

def _tensor_plan(spec: ModelSpec, weights: dict) -> list[tuple[str, WeightMatrix | np.ndarray, np.ndarray | None]]:
    """(GGUF name, served tensor, rows of it to write or None for all): fused matrices split lazily."""
    q, kv, inter, D = spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    plan = [("token_embd.weight", weights["embed"], None), ("output_norm.weight", weights["norm"], None)]
    if not spec.tie_word_embeddings:
        plan.append(("output.weight", weights["lm_head"], None))
    if _rope_type(spec) == "llama3":
        plan.append(("rope_freqs.weight", rope_freq_factors(spec), None))
    q_rows, k_rows = rope_row_order(spec.num_heads, D), q + rope_row_order(spec.num_kv_heads, D)
    for i, layer in enumerate(weights["layers"]):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", layer["input_norm"], None),
                 (p + "attn_q.weight", layer["qkv"], q_rows),
                 (p + "attn_k.weight", layer["qkv"], k_rows),
                 (p + "attn_v.weight", layer["qkv"], np.arange(q + kv, q + 2 * kv)),
                 (p + "attn_output.weight", layer["o"], None),
                 (p + "ffn_norm.weight", layer["post_norm"], None),
                 (p + "ffn_gate.weight", layer["gate_up"], np.arange(inter)),
                 (p + "ffn_up.weight", layer["gate_up"], np.arange(inter, 2 * inter)),
                 (p + "ffn_down.weight", layer["down"], None)]
    return plan


def _tensor_info(t: WeightMatrix | np.ndarray, rows) -> tuple[tuple[int, ...], GGMLQuantizationType, int]:
    """-> (shape in elements, GGUF type, bytes) without building the data."""
    kind = GT.F32 if isinstance(t, np.ndarray) else _GGML_TYPE[t.dtype]
    shape = t.shape if rows is None else (len(rows), t.shape[1])
    block, size = GGML_QUANT_SIZES[kind]
    return shape, kind, math.prod(shape) // block * size


def _tensor_data(t: WeightMatrix | np.ndarray, rows) -> np.ndarray:
    """GGML's layout: F32 as is; BF16, Q8_0, Q4_0 as uint8 [N, bytes per row] of (fp16 d, qs) blocks."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t, np.float32)
    w = t if rows is None else _take_rows(t, rows)
    if w.dtype == "float32":
        return np.ascontiguousarray(w.data)
    if w.dtype == "bfloat16":
        return np.ascontiguousarray(w.data).view(np.uint8)
    n, num_blocks = w.scales.shape
    scales = np.ascontiguousarray(w.scales).view(np.uint8).reshape(n, num_blocks, 2)
    qs = np.ascontiguousarray(w.data).view(np.uint8).reshape(n, num_blocks, -1)  # [N, K // 32, 32 | 16]
    return np.concatenate([scales, qs], axis=2).reshape(n, -1)


def _add_model_metadata(writer: GGUFWriter, spec: ModelSpec, weights: dict, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(_FILE_TYPE[weights["layers"][0]["qkv"].dtype])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_block_count(spec.num_layers)
    writer.add_feed_forward_length(spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    writer.add_key_length(spec.head_dim)
    writer.add_value_length(spec.head_dim)
    writer.add_rope_dimension_count(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    if spec.rope_scaling:
        writer.add_string(ROPE_SCALING_KEY, json.dumps(spec.rope_scaling))
    if _rope_type(spec) == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(spec.rope_scaling["factor"])


def _add_vocab(writer: GGUFWriter, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for kind, token_id in (("bos", vocab.bos), ("eos", vocab.eos), ("unk", vocab.unk)):
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)


def export_gguf(spec: ModelSpec, weights: dict, tokenizer: Tokenizer | None, out_path: str | Path,
                name: str = "numaserve export") -> Path:
    """Write a loaded model as a llama GGUF file llama.cpp runs: every tensor in its served format (q8_0 ->
    Q8_0, q4_0 -> Q4_0, bfloat16 -> BF16, float32 -> F32, norms F32), byte for byte. A model without a
    tokenizer gets a synthetic byte-level vocabulary of vocab_size tokens."""
    if spec.qkv_bias or any(spec.layer_windows):
        raise CheckpointError(f"{spec.architecture} with attention biases or sliding windows has no llama GGUF "
                              "equivalent; convert it with llama.cpp's convert_hf_to_gguf.py")
    out_path = Path(out_path)
    vocab = synthetic_vocab(spec) if tokenizer is None else vocab_from_tokenizer(spec, tokenizer)
    tmp = out_path.with_name(out_path.name + ".tmp")
    writer = GGUFWriter(tmp, ARCH)
    _add_model_metadata(writer, spec, weights, name)
    _add_vocab(writer, vocab)
    plan = _tensor_plan(spec, weights)
    for tensor_name, t, rows in plan:
        shape, kind, nbytes = _tensor_info(t, rows)
        writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)  # shape in elements
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t, rows in plan:  # one tensor in memory at a time
        writer.write_tensor_data(_tensor_data(t, rows))
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def convert_to_gguf(model_path: str | Path, out_path: str | Path, weight_dtype: str = "q8_0") -> Path:
    """Load a Hugging Face directory (or a GGUF) at `weight_dtype` and write it as GGUF."""
    spec, weights, tokenizer = load_model(model_path, weight_dtype)
    return export_gguf(spec, weights, tokenizer, out_path, name=Path(model_path).name)
