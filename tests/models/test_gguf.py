"""GGUF interop: export-then-load is exact, files written by the gguf package's own writer (as llama.cpp's
convert_hf_to_gguf.py writes them) load to the Hugging Face checkpoint's weights, the GGUF tokenizer
tokenizes as tokenizer.json does, bad files fail with CheckpointError, and llama.cpp runs our exports (when
installed)."""

import collections
import importlib.util
import itertools
import json
import math
import re
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType
from safetensors.numpy import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import models.gguf.writer
import numaserve as ns
from cluster_configs.errors import CheckpointError
from models.gguf.families import FAMILIES
from models.gguf.format import llama3_scaling_from_factors
from models.gguf.reader import read_gguf
from models.gguf.writer import convert_to_gguf
from models.linear import dequantize
from models.loader import load_model
from models.rope import Rope, inv_freq
from tests.conftest import random_prompt
from tests.models.test_hf_parity import hf_logits
from tests.support.model_factory import CORPUS

DTYPES = ("float32", "float16", "bfloat16", "q8_0", "q4_0")
VARIANTS = ("llama", "llama_tied")
TEXTS = ["The quick brown fox jumps over the lazy dog.", "def add(a, b):\n    return a + b\n",
         "Grüße aus Köln! Ünïcödé tëxt, emoji 🙂 and ∑ symbols.", "  two  spaces\n\n\tand tabs  ",
         "<s>special</s> tokens inside text",
         "numaserve serves language models on CPUs, one worker per NUMA node.", ""]


def make_llm(path, weight_dtype="auto") -> ns.LLM:
    return ns.LLM(path, weight_dtype=weight_dtype, kv_dtype="float32", max_model_len=128, max_num_seqs=1)


# ---- an independent GGUF writer: the gguf package, used the way convert_hf_to_gguf.py uses it --------------

def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py DecoderModel.permute, in numpy."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """convert_hf_to_gguf.py DecoderModel.generate_extra_tensors for rope_type llama3."""
    rope = cfg["rope_parameters"]
    dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_context_len = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context_len / low, old_context_len / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, np.float32)


def add_gpt2_vocab(w: gguf.GGUFWriter, model_dir: Path, vocab_size: int) -> None:
    """convert_hf_to_gguf.py get_vocab_base + gguf.SpecialVocab."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    reverse = {i: t for t, i in tok.vocab.items()}
    added = tok.added_tokens_decoder
    tokens = [reverse.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED if i not in reverse else gguf.TokenType.NORMAL if i not in added
             else gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED
             for i in range(vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(w)


def hf_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(f)
    return tensors


def reference_gguf(model_dir: Path, out: Path, ftype: GT = GT.F16, drop=(), metadata=None, extra=None,
                   spm_vocab=None) -> Path:
    """A llama GGUF as convert_hf_to_gguf.py writes it: tensors in `ftype` (q8_0 / q4_0 through gguf.quants;
    a Q4_0 file keeps output and a tied token_embd in Q8_0), norms F32, q/k rows permuted, gpt2 vocabulary.
    drop: keys or tensor names to leave out; metadata: key -> (value, GGUFValueType); extra: more tensors,
    name -> (array, raw GGML type or None); spm_vocab: (tokens, scores, types) written as a "llama"
    vocabulary."""
    cfg = json.loads((model_dir / "config.json").read_text())
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(out, "llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg["rope_parameters"]  # transformers 5: rope_theta and the scaling
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_file_type({GT.F16: 1, GT.Q8_0: 7, GT.Q4_0: 2}[ftype])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_vocab_size(cfg["vocab_size"])
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["factor"])
    if rope["rope_type"] == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))

    if spm_vocab is None:
        add_gpt2_vocab(w, model_dir, cfg["vocab_size"])
    else:
        w.add_tokenizer_model("llama")
        for add, values in zip((w.add_token_list, w.add_token_scores, w.add_token_types), spm_vocab):
            add(values)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    tied = cfg.get("tie_word_embeddings", False)
    for hf_name, data in hf_tensors(model_dir).items():
        if hf_name.endswith("q_proj.weight"):
            data = permute(data, n_head, n_head)
        if hf_name.endswith("k_proj.weight"):
            data = permute(data, n_head, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        kind = GT.F32 if data.ndim == 1 else ftype
        if kind == GT.Q4_0 and (name == "output.weight" or name == "token_embd.weight" and tied):
            kind = GT.Q8_0
        if kind in (GT.F32, GT.F16):
            w.add_tensor(name, data.astype(np.float32 if kind == GT.F32 else np.float16))
        else:
            w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), kind), raw_dtype=kind)
    for name, (data, kind) in (extra or {}).items():
        w.tensors[0].pop(name, None)
        w.add_tensor(name, data, raw_dtype=kind)
    return finish_gguf(w, out, metadata, drop)


def finish_gguf(w: gguf.GGUFWriter, out: Path, metadata=None, drop=()) -> Path:
    """Set metadata (key -> (value, GGUFValueType)), leave out the keys or tensors in drop, write, close."""
    for key, (value, vtype) in (metadata or {}).items():
        w.add_key_value(key, value, vtype)
    for key in drop:
        w.kv_data[0].pop(key, None)
        w.tensors[0].pop(key, None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def f16_dirs(model_dirs, tmp_path_factory) -> dict:
    """variant -> copy of the HF checkpoint with every weight rounded to float16 (what an F16 GGUF holds)."""
    root = tmp_path_factory.mktemp("f16")
    dirs = {}
    for variant in VARIANTS:
        dirs[variant] = root / variant
        shutil.copytree(model_dirs[variant], dirs[variant])
        for f in dirs[variant].glob("*.safetensors"):
            save_file({k: v.astype(np.float16).astype(np.float32) for k, v in load_file(f).items()}, f)
    return dirs


@pytest.fixture(scope="module")
def reference_f16(model_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ref")
    return {v: reference_gguf(model_dirs[v], root / f"{v}-f16.gguf") for v in VARIANTS}


@pytest.fixture(scope="module")
def exported(model_dirs, tmp_path_factory) -> dict:
    """(variant, dtype) -> our export of the HF checkpoint served in dtype."""
    root = tmp_path_factory.mktemp("export")
    return {(v, dt): convert_to_gguf(model_dirs[v], root / f"{v}-{dt}.gguf", dt)
            for v in VARIANTS for dt in DTYPES}


# ---- export then load ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_load_gives_identical_logits(variant, dtype, model_dirs, exported):
    tokens = random_prompt(70, seed=3)
    original = make_llm(model_dirs[variant], dtype)
    loaded = make_llm(exported[variant, dtype])  # "auto": the types the file stores
    assert loaded.engine.model.weight_dtype == dtype
    assert loaded.engine.spec == original.engine.spec
    assert np.array_equal(loaded.score(tokens), original.score(tokens))


@pytest.mark.parametrize("dtype, stored", [("float32", GT.F32), ("float16", GT.F16), ("bfloat16", GT.BF16),
                                           ("q8_0", GT.Q8_0), ("q4_0", GT.Q4_0)])
def test_export_writes_served_types_and_llama_metadata(dtype, stored, exported):
    metadata, tensors = read_gguf(exported["llama", dtype])
    assert tensors["blk.0.attn_q.weight"].ggml_type == stored
    assert tensors["blk.1.ffn_down.weight"].ggml_type == stored
    assert tensors["output.weight"].ggml_type == (GT.Q8_0 if dtype == "q4_0" else stored)  # lm_head_dtype
    assert tensors["output_norm.weight"].ggml_type == GT.F32
    assert tensors["rope_freqs.weight"].shape == (12,)  # llama3 scaling, for llama.cpp
    assert metadata["general.architecture"] == "llama"
    assert metadata["general.file_type"] == {"float32": 0, "float16": 1, "bfloat16": 32, "q8_0": 7,
                                             "q4_0": 2}[dtype]
    assert metadata["llama.attention.key_length"] == 24 and metadata["llama.block_count"] == 2
    assert metadata["tokenizer.ggml.model"] == "gpt2" and metadata["tokenizer.ggml.pre"] == "gpt-2"
    assert len(metadata["tokenizer.ggml.tokens"]) == 384


@pytest.mark.parametrize("dtype", DTYPES)
def test_exported_blocks_decode_with_ggml_reference_to_the_served_values(dtype, model_dirs, exported):
    # gguf.quants.dequantize is GGML's reference decoder: it must read our bytes as the values we serve
    spec, weights, _ = load_model(model_dirs["llama"], dtype)
    tensors = {t.name: t for t in gguf.GGUFReader(exported["llama", dtype]).tensors}
    qkv = dequantize(weights.layers[1].qkv)  # [q + 2 kv, hidden]: q rows in Hugging Face order
    q_gguf = gguf.quants.dequantize(tensors["blk.1.attn_q.weight"].data,
                                    tensors["blk.1.attn_q.weight"].tensor_type)
    assert np.array_equal(q_gguf, permute(qkv[:spec.q_size], spec.num_heads, spec.num_heads))
    down = tensors["blk.0.ffn_down.weight"]
    assert np.array_equal(gguf.quants.dequantize(down.data, down.tensor_type),
                          dequantize(weights.layers[0].down))


def test_a_load_copies_each_layer_s_tensors_as_the_layer_is_built(exported, monkeypatch):
    """What bounds a cold start's memory: beside the weights built, the file's copy of one layer, not of the
    model (each tensor copied when its layer takes it)."""
    from models.gguf import reader

    copied, seen = [], []
    copy = reader._copy_tensor
    monkeypatch.setattr(reader, "_copy_tensor",
                        lambda path, t, *a: copied.append(t.name) or copy(path, t, *a))

    def each_layer(i, layer):
        layers = {int(m.group(1)) for m in map(re.compile(r"blk\.(\d+)\.").match, copied) if m}
        seen.append((i, layers))
        return layer

    spec, _, _ = load_model(exported["llama", "q8_0"], "auto", each_layer=each_layer)
    assert [i for i, _ in seen] == list(range(spec.num_layers))
    assert all(layers == set(range(i + 1)) for i, layers in seen)
    assert len(copied) == len(set(copied))  # each tensor copied once


def test_tied_export_has_no_output_tensor(exported):
    _, tensors = read_gguf(exported["llama_tied", "q4_0"])
    assert "output.weight" not in tensors
    assert tensors["token_embd.weight"].ggml_type == GT.Q8_0  # tied: the lm_head's precision


def test_reexport_of_a_loaded_gguf_keeps_every_tensor_and_key(exported, tmp_path):
    first = exported["llama", "q4_0"]
    again = convert_to_gguf(first, tmp_path / "again.gguf", "q4_0")
    (meta_a, tensors_a), (meta_b, tensors_b) = read_gguf(first), read_gguf(again)
    assert {k: v for k, v in meta_a.items() if k != "general.name"} == \
        {k: v for k, v in meta_b.items() if k != "general.name"}
    assert tensors_a.keys() == tensors_b.keys()
    for name, a in tensors_a.items():
        b = tensors_b[name]
        assert a.ggml_type == b.ggml_type and np.array_equal(a.value.data, b.value.data), name
        assert a.value.scales is None or np.array_equal(a.value.scales, b.value.scales), name


# ---- files written by the gguf package (the way convert_hf_to_gguf.py writes them) -------------------------

@pytest.mark.parametrize("weight_dtype", ["float32", "auto", "q8_0", "q4_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_f16_gguf_serves_the_hf_checkpoint_weights(variant, weight_dtype, f16_dirs, reference_f16):
    # The F16 file holds the checkpoint's weights rounded to float16: numaserve serving that rounded
    # checkpoint from safetensors must give bit-identical logits (same values, q/k un-permuted, rope scaling
    # recovered).
    tokens = random_prompt(70, seed=4)
    hf_dtype = "float16" if weight_dtype == "auto" else weight_dtype
    ours = make_llm(reference_f16[variant], weight_dtype)
    assert ours.engine.model.weight_dtype == hf_dtype
    assert np.array_equal(ours.score(tokens), make_llm(f16_dirs[variant], hf_dtype).score(tokens))


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_f16_gguf_serves_every_f16_tensor_bit_for_bit(variant, reference_f16):
    # each served matrix holds the file's F16 bits: q / k rows back in Hugging Face's order, fused as served
    spec, weights, _ = load_model(reference_f16[variant], "auto")
    file_bits = {t.name: np.asarray(t.data).view(np.uint16)
                 for t in gguf.GGUFReader(reference_f16[variant]).tensors if t.tensor_type == GT.F16}

    def bits(name: str, rows: np.ndarray | None = None) -> np.ndarray:
        return file_bits[name] if rows is None else file_bits[name][rows]

    def served(w) -> np.ndarray:
        assert w.dtype == "float16"
        return w.data.view(np.uint16)

    q_rows = np.argsort(permute(np.arange(spec.q_size), spec.num_heads, spec.num_heads))
    k_rows = np.argsort(permute(np.arange(spec.kv_size), spec.num_heads, spec.num_kv_heads))
    checked = {"token_embd.weight"} | (set() if spec.tie_word_embeddings else {"output.weight"})
    assert np.array_equal(served(weights.embed), bits("token_embd.weight"))
    assert spec.tie_word_embeddings or np.array_equal(served(weights.lm_head), bits("output.weight"))
    for i, layer in enumerate(weights.layers):
        b = f"blk.{i}."
        expected = {"qkv": [bits(b + "attn_q.weight", q_rows), bits(b + "attn_k.weight", k_rows),
                            bits(b + "attn_v.weight")],
                    "o": [bits(b + "attn_output.weight")],
                    "gate_up": [bits(b + "ffn_gate.weight"), bits(b + "ffn_up.weight")],
                    "down": [bits(b + "ffn_down.weight")]}
        for key, parts in expected.items():
            assert np.array_equal(served(layer.projection(key)), np.concatenate(parts)), (i, key)
        checked |= {f"{b}{name}.weight" for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                     "ffn_up", "ffn_down")}
    assert checked == file_bits.keys()  # every F16 tensor of the file


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_f16_gguf_logits_equal_transformers_over_the_f16_values(variant, reference_f16, f16_dirs):
    # "auto" serves the F16 matrices with float32 activations: transformers (float32) over the same float16
    # values gives the same logits within test_hf_parity's 1e-4
    tokens = random_prompt(70, seed=5)
    rounded = AutoModelForCausalLM.from_pretrained(f16_dirs[variant], dtype=torch.float32).eval()
    np.testing.assert_allclose(make_llm(reference_f16[variant]).score(tokens), hf_logits(rounded, tokens),
                               atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_f16_gguf_matches_transformers_within_f16_rounding(variant, reference_f16, f16_dirs,
                                                                     hf_models):
    # Tolerance: what rounding the weights to float16 does to transformers' own logits (about 0.01 with these
    # large random weights), plus test_hf_parity's 1e-4 between numaserve and transformers. A missing q/k
    # un-permutation moves the logits by more than 5.
    tokens = random_prompt(70, seed=5)
    reference = hf_logits(hf_models[variant], tokens)
    rounded = AutoModelForCausalLM.from_pretrained(f16_dirs[variant], dtype=torch.float32).eval()
    f16_effect = np.abs(hf_logits(rounded, tokens) - reference).max()
    assert 0 < f16_effect < 0.05
    ours = make_llm(reference_f16[variant], "float32").score(tokens)
    assert np.abs(ours - reference).max() <= f16_effect + 1e-4


@pytest.mark.parametrize("ftype, dtype", [(GT.Q8_0, "q8_0"), (GT.Q4_0, "q4_0")], ids=["Q8_0", "Q4_0"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_quantized_gguf_keeps_its_blocks(variant, ftype, dtype, f16_dirs, model_dirs, tmp_path):
    # gguf.quants quantizes the float16-rounded weights exactly as numaserve does: loading the blocks byte
    # for byte must equal quantizing the rounded checkpoint at load time.
    path = reference_gguf(f16_dirs[variant], tmp_path / "ref.gguf", ftype)
    tokens = random_prompt(40, seed=6)
    assert np.array_equal(make_llm(path).score(tokens), make_llm(f16_dirs[variant], dtype).score(tokens))


def test_llama3_scaling_is_recovered_from_rope_freqs():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # Llama 3.1
    cfg = {"hidden_size": 4096, "num_attention_heads": 32,
           "rope_parameters": scaling | {"rope_theta": 500000.0}}
    assert llama3_scaling_from_factors(llama3_rope_factors(cfg), 500000.0, 128) == scaling
    assert llama3_scaling_from_factors(np.ones(64, np.float32), 500000.0, 128) is None


@pytest.mark.parametrize("theta, head_dim, original, low, high, factor", [
    (10000.0, 8, 64, 1.0, 4.0, 8.0),  # one frequency on the ramp
    (10000.0, 32, 512, 1.0, 1.5, 16.0),  # one frequency on the ramp, binding low boundary
    (10000.0, 64, 100, 2.0, 3.0, 4.0),  # low_freq_factor != 1: only ratios are determined
    (10000.0, 16, 4096, 1.0, 1.2, 8.0),  # none on the ramp
])
def test_llama3_scaling_from_rope_freqs_reproduces_the_frequencies(theta, head_dim, original, low, high,
                                                                   factor):
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": original}
    cfg = {"head_dim": head_dim, "rope_parameters": scaling | {"rope_theta": theta}}
    recovered = llama3_scaling_from_factors(llama3_rope_factors(cfg), theta, head_dim)
    expected, _ = inv_freq(Rope(theta, scaling, head_dim))
    np.testing.assert_allclose(inv_freq(Rope(theta, recovered, head_dim))[0], expected, rtol=1e-6)


# ---- tokenizer -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("source", ["export", "reference"])
def test_gguf_tokenizer_tokenizes_like_tokenizer_json(source, llama_dir, f16_dirs, exported, reference_f16):
    # the reference file holds the checkpoint rounded to f16 ("auto" serves it as bfloat16)
    path, hf_dir, dtype = ((exported["llama", "q8_0"], llama_dir, "q8_0") if source == "export"
                           else (reference_f16["llama"], f16_dirs["llama"], "bfloat16"))
    ours, theirs = make_llm(path), make_llm(hf_dir, dtype)
    for text in TEXTS:
        ids = theirs.tokenizer.encode(text)
        assert ours.tokenizer.encode(text) == ids, text
        assert ours.tokenizer.decode(ids) == theirs.tokenizer.decode(ids)
    assert ours.tokenizer.special_ids == theirs.tokenizer.special_ids
    greedy = ns.SamplingParams(max_tokens=8, temperature=0)
    assert (ours.generate("The quick brown fox", greedy)[0].text
            == theirs.generate("The quick brown fox", greedy)[0].text)


def spm_vocab(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece-style vocabulary: <unk> <s> </s>, the 256 <0xXX> byte tokens, characters, then pieces
    learned by merging the most frequent adjacent pair (a piece scores minus its merge step), unused
    padding."""
    words = [list("\u2581" + w) for w in " ".join(CORPUS).split()]
    pieces = sorted({c for w in words for c in w})
    scores = [-1000.0] * len(pieces)
    while len(pieces) < size - 259:
        pairs = collections.Counter(p for w in words for p in itertools.pairwise(w))
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        pieces.append(a + b)
        scores.append(-float(len(pieces)))
        words = [merge_pair(w, a, b) for w in words]
    T = gguf.TokenType
    num_pad = size - 259 - len(pieces)
    return (["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)] + pieces
            + [f"[PAD{i}]" for i in range(num_pad)],
            [0.0] * 259 + scores + [-1e9] * num_pad,
            [T.UNKNOWN, T.CONTROL, T.CONTROL] + [T.BYTE] * 256 + [T.NORMAL] * len(pieces)
            + [T.UNUSED] * num_pad)


def merge_pair(symbols: list[str], a: str, b: str) -> list[str]:
    out = []
    for s in symbols:
        if out and out[-1] == a and s == b:
            out[-1] = a + b
        else:
            out.append(s)
    return out


def llama_cpp_spm_tokenize(text: str, tokens: list[str], scores: list[float]) -> list[int]:
    """llama.cpp's llm_tokenizer_spm: BOS, then for each fragment between special tokens a space prefix,
    spaces as U+2581, the best-scoring adjacent pair merged first (leftmost on ties), unknown pieces as
    bytes."""
    vocab = {t: i for i, t in enumerate(tokens)}
    ids = [vocab["<s>"]]
    for fragment in re.split("(<s>|</s>)", text):
        if fragment in ("<s>", "</s>"):
            ids.append(vocab[fragment])
            continue
        if not fragment:
            continue
        symbols = list(("\u2581" + fragment).replace(" ", "\u2581"))
        while True:
            candidates = [(scores[vocab[a + b]], -i) for i, (a, b) in enumerate(itertools.pairwise(symbols))
                          if a + b in vocab]
            if not candidates:
                break
            i = -max(candidates)[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for piece in symbols:
            ids += [vocab[piece]] if piece in vocab else [vocab[f"<0x{b:02X}>"] for b in piece.encode()]
    return ids


def test_sentencepiece_vocabulary_tokenizes_as_llama_cpp_does(llama_dir, tmp_path):
    tokens, scores, types = spm_vocab(384)
    path = reference_gguf(llama_dir, tmp_path / "spm.gguf", spm_vocab=(tokens, scores, types))
    tokenizer = make_llm(path).tokenizer
    texts = TEXTS[:4] + ["hello world", "the lazy dog sleeps", " leading space", "the dog<s>the fox</s> and",
                         "zebra quokka ✓"]
    for text in texts:
        assert tokenizer.encode(text) == llama_cpp_spm_tokenize(text, tokens, scores), text
        if "<s>" not in text:
            assert tokenizer.decode(tokenizer.encode(text)) == text


def test_model_without_tokenizer_exports_a_synthetic_vocabulary(llama_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(llama_dir, bare)
    (bare / "tokenizer.json").unlink()
    path = convert_to_gguf(bare, tmp_path / "bare.gguf", "q8_0")
    metadata, _ = read_gguf(path)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == 384 and tokens[1:3] == ["<s>", "</s>"]
    assert metadata["tokenizer.ggml.merges"]  # llama.cpp refuses a gpt2 vocabulary without merges
    llm = make_llm(path)
    assert llm.tokenizer is not None
    assert np.array_equal(llm.score([1, 5, 9]), make_llm(bare, "q8_0").score([1, 5, 9]))


# ---- bad input -------------------------------------------------------------------------------------------

def iq3_s_junk(rows: int) -> tuple[np.ndarray, GT]:
    return np.zeros((rows, 110), np.uint8), GT.IQ3_S  # one 256-value IQ3_S block per row


BAD_FILES = {
    "architecture": ({"metadata": {"general.architecture": ("gpt2", GGUFValueType.STRING)}},
                     "general.architecture='gpt2'"),
    # refused by type as each tensor is read, before its name or shape is looked at
    "tensor_type": ({"extra": {"blk.0.attn_iq3.weight": iq3_s_junk(4)}},
                    "'blk.0.attn_iq3.weight' is IQ3_S, an I-quant .* Q4_K_M"),
    "missing_tensor": ({"drop": ["blk.1.ffn_down.weight"]}, "'blk.1.ffn_down.weight' is missing"),
    "missing_key": ({"drop": ["llama.block_count"]}, "'llama.block_count' is missing"),
    "wrong_shape": ({"metadata": {"llama.feed_forward_length": (128, GGUFValueType.UINT32)}},
                    "'blk.0.ffn_gate.weight' has shape \\(96, 64\\), expected \\(128, 64\\)"),
    "extra_tensor": ({"extra": {"blk.0.attn_q.bias": (np.zeros(96, np.float32), None)}}, "attn_q.bias"),
    "rope_scaling": ({"metadata": {"llama.rope.scaling.type": ("yarn", GGUFValueType.STRING)}}, "'yarn'"),
    "tokenizer_pre": ({"metadata": {"tokenizer.ggml.pre": ("deepseek-coder", GGUFValueType.STRING)}},
                      "tokenizer.ggml.pre='deepseek-coder'"),
    "tokenizer_model": ({"metadata": {"tokenizer.ggml.model": ("bert", GGUFValueType.STRING)}},
                        "tokenizer.ggml.model='bert'"),
    # a llama file with experts is Mixtral (tests/models/test_gguf_moe.py): this one lacks how many a token
    # uses
    "moe": ({"metadata": {"llama.expert_count": (8, GGUFValueType.UINT32)}}, "expert_used_count. is missing"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_gguf_raises_checkpoint_error_naming_the_problem(case, llama_dir, tmp_path):
    edits, message = BAD_FILES[case]
    path = reference_gguf(llama_dir, tmp_path / f"{case}.gguf", **edits)
    with pytest.raises(CheckpointError, match=message) as e:
        make_llm(path)
    assert str(path) in str(e.value)


def test_files_that_are_not_gguf_raise_checkpoint_error(exported, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello, I am not a model")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(exported["llama", "q8_0"].read_bytes()[:20000])
    for path, message in [(text, "not a readable GGUF"), (truncated, "not a readable GGUF"),
                          (tmp_path / "missing.gguf", "no such file")]:
        with pytest.raises(CheckpointError, match=message):
            make_llm(path)


def test_export_refuses_an_architecture_without_a_gguf_family(model_dirs, tmp_path, monkeypatch):
    # as if qwen2 were a family numaserve serves but has no llama.cpp names for
    monkeypatch.setattr(models.gguf.writer, "FAMILIES", {k: f for k, f in FAMILIES.items() if k != "qwen2"})
    with pytest.raises(CheckpointError, match="Qwen2ForCausalLM has no GGUF architecture numaserve writes"):
        convert_to_gguf(model_dirs["qwen2"], tmp_path / "qwen2.gguf", "q8_0")


# ---- llama.cpp (the optional bench extra) ------------------------------------------------------------------

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python (the bench extra) is not installed")
# llama.cpp quantizes the activations of its Q8_0 / Q4_0 dot products to q8_0 and rounds those of F16 / BF16
# ones to fp16 / bf16, so only F32 agrees to float32 rounding. Measured max |diff| on these models (logit std
# 1.2): F32 6e-6, F16 0.010, BF16 0.05, Q8_0 0.13, Q4_0 0.15; the bounds leave 2x margin, a wrong rope or
# permutation gives > 5.
LLAMA_CPP_TOLERANCE = {"float32": 1e-4, "float16": 0.02, "bfloat16": 0.1, "q8_0": 0.3, "q4_0": 0.3}


def llama_cpp(path: Path, **kwargs):
    from llama_cpp import Llama

    return Llama(str(path), n_threads=1, n_threads_batch=1, use_mmap=False, verbose=False, **kwargs)


@needs_llama_cpp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_runs_our_export_with_matching_logits(variant, dtype, model_dirs, exported):
    tokens = random_prompt(60, seed=7)
    # f32 KV like ours
    llm = llama_cpp(exported[variant, dtype], n_ctx=64, logits_all=True, type_k=0, type_v=0)
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:len(tokens)], np.float32)
    ours = make_llm(model_dirs[variant], dtype).score(tokens)
    assert np.abs(theirs - ours).max() < LLAMA_CPP_TOLERANCE[dtype]


@needs_llama_cpp
@pytest.mark.parametrize("source", ["gpt2", "sentencepiece", "synthetic"])
def test_llama_cpp_tokenizes_like_our_gguf_tokenizer(source, llama_dir, exported, tmp_path):
    if source == "gpt2":
        path = exported["llama", "q8_0"]
    elif source == "sentencepiece":
        path = reference_gguf(llama_dir, tmp_path / "spm.gguf", spm_vocab=spm_vocab(384))
    else:
        bare = tmp_path / "bare"
        shutil.copytree(llama_dir, bare)
        (bare / "tokenizer.json").unlink()
        path = convert_to_gguf(bare, tmp_path / "bare.gguf", "q8_0")
    theirs, ours = llama_cpp(path, vocab_only=True), make_llm(path).tokenizer
    for text in TEXTS + ["the dog<s>the fox</s> and", " leading space", "a\n\nb", "zebra quokka ✓"]:
        assert theirs.tokenize(text.encode(), add_bos=True, special=True) == ours.encode(text), text
