"""GGUF interop beyond Llama (Qwen 2/3, Gemma 2/3, Phi-3, Granite, OLMo 2, SmolLM3): export-then-load is
exact, our exports use llama.cpp's architecture, tensor names and row order, files written the way llama.cpp's
convert_hf_to_gguf.py writes them (by the gguf package, in this file) load to transformers' logits, bad files
fail with CheckpointError, and llama.cpp runs our exports (when installed)."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType
from transformers import AutoModelForCausalLM

import models.gguf.model_spec
from cluster_configs.errors import CheckpointError
from models.gguf.reader import read_gguf
from models.gguf.writer import convert_to_gguf, export_gguf
from models.loader import load_model
from tests.conftest import random_prompt
from tests.models.test_gguf import (
    add_gpt2_vocab,
    finish_gguf,
    hf_tensors,
    llama_cpp,
    make_llm,
    needs_llama_cpp,
    permute,
)
from tests.models.test_hf_parity import hf_logits
from tests.support.model_factory import build_model

VARIANTS = ("qwen2", "qwen3", "gemma2", "gemma3", "phi3", "granite", "olmo2", "smollm3")
DTYPES = ("float32", "bfloat16", "q8_0", "q4_0")
GGUF_ARCH = {"Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
             "Gemma3ForCausalLM": "gemma3", "Phi3ForCausalLM": "phi3", "GraniteForCausalLM": "granite",
             "Olmo2ForCausalLM": "olmo2", "SmolLM3ForCausalLM": "smollm3"}
# llama.cpp's "normal" rope (convert_hf_to_gguf's LlamaModel subclasses): q/k rows interleaved per head
NORM_ROPE = {"granite", "smollm3"}
# The checkpoints of the reference tests, where the test variants hold numbers llama.cpp's files cannot:
# llama.cpp scores Gemma by the head size (query_pre_attn_scalar = head_dim, as in Gemma's 2B to 12B models),
# puts Gemma 3's global layers every 6th and SmolLM3's no-rope layers every 4th, and has no key for Qwen's
# sliding window.
REFERENCE_CHECKPOINTS = {"qwen3": {"use_sliding_window": False, "layer_types": None},
                         "gemma2": {"query_pre_attn_scalar": 16},
                         "gemma3": {"num_hidden_layers": 7, "query_pre_attn_scalar": 16, "layer_types": None},
                         "smollm3": {"num_hidden_layers": 4, "no_rope_layers": None}}


# ---- an independent GGUF writer: the gguf package, used the way convert_hf_to_gguf.py uses it --------------

def reference_gguf(model_dir: Path, out: Path, ftype: GT = GT.F32, metadata=None, drop=()) -> Path:
    """A GGUF of a Hugging Face checkpoint as convert_hf_to_gguf.py writes it for its family: that family's
    keys (TextModel's common ones, LlamaModel's vocab size and rope dimensions, Gemma's soft-caps and window,
    Phi-3's LongRoPE factors, Granite's multipliers), Gemma's norms + 1, q/k rows permuted for the
    normal-rope families, matrices in `ftype`, vectors F32. metadata: key -> (value, GGUFValueType) set
    afterwards; drop: keys or tensor names left out."""
    cfg = json.loads((model_dir / "config.json").read_text())
    arch = GGUF_ARCH[cfg["architectures"][0]]
    n_layers, n_head, n_kv, hidden = (cfg["num_hidden_layers"], cfg["num_attention_heads"],
                                      cfg["num_key_value_heads"], cfg["hidden_size"])
    rope = cfg["rope_parameters"]
    full = rope.get("full_attention", rope)
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type({GT.F32: 0, GT.Q8_0: 7}[ftype])
    if arch != "gemma2":  # Gemma2Model writes its own keys, without the rope base
        w.add_rope_freq_base(full["rope_theta"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if full["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    if arch in NORM_ROPE:
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg.get("head_dim") or hidden // n_head)
    if arch.startswith("gemma"):
        w.add_sliding_window(cfg["sliding_window"])
        if cfg.get("attn_logit_softcapping"):
            w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if arch == "granite":
        w.add_attention_scale(cfg["attention_multiplier"])
        w.add_embedding_scale(cfg["embedding_multiplier"])
        w.add_residual_scale(cfg["residual_multiplier"])
        w.add_logit_scale(cfg["logits_scaling"])
    if arch == "phi3":  # Phi3MiniModel: partial rotary from hidden / heads, LongRoPE factors as tensors
        original = cfg["original_max_position_embeddings"]
        scale = cfg["max_position_embeddings"] / original
        w.add_rope_scaling_orig_ctx_len(original)
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * hidden) // n_head)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
        w.add_rope_scaling_attn_factors(np.sqrt(1 + np.log(scale) / np.log(original)) if scale > 1 else 1.0)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    add_gpt2_vocab(w, model_dir, cfg["vocab_size"])

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    for hf_name, data in hf_tensors(model_dir).items():
        if arch.startswith("gemma") and hf_name.endswith("norm.weight"):
            data = data + np.float32(1.0)  # Gemma's RMSNorm scales by 1 + weight
        if arch in NORM_ROPE and ".q_proj." in hf_name:
            data = permute(data, n_head, n_head)
        if arch in NORM_ROPE and ".k_proj." in hf_name:
            data = permute(data, n_head, n_kv)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if data.ndim == 1 or ftype == GT.F32:
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), ftype), raw_dtype=ftype)
    return finish_gguf(w, out, metadata, drop)


@pytest.fixture(scope="module")
def exported(model_dirs, tmp_path_factory) -> dict:
    """(variant, dtype) -> our export of the HF checkpoint served in dtype."""
    root = tmp_path_factory.mktemp("export")
    return {(v, dt): convert_to_gguf(model_dirs[v], root / f"{v}-{dt}.gguf", dt)
            for v in VARIANTS for dt in DTYPES}


@pytest.fixture(scope="module")
def reference_dirs(model_dirs, tmp_path_factory) -> dict:
    """variant -> a checkpoint whose numbers llama.cpp's keys can hold (REFERENCE_CHECKPOINTS)."""
    root = tmp_path_factory.mktemp("reference")
    dirs = dict(model_dirs)
    for variant, overrides in REFERENCE_CHECKPOINTS.items():
        build_model(root / variant, variant, **overrides)
        dirs[variant] = root / variant
    return dirs


# ---- export then load ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_load_gives_identical_logits(variant, dtype, model_dirs, exported):
    # numaserve.spec carries what llama.cpp's float32 keys round (Gemma's query scale, LongRoPE factors) and
    # what they cannot say (Qwen 3's window is a llama.cpp pattern key; SmolLM3's rope-less layer is not)
    tokens = random_prompt(70, seed=3)
    original = make_llm(model_dirs[variant], dtype)
    loaded = make_llm(exported[variant, dtype])  # "auto": the types the file stores
    assert loaded.engine.model.weight_dtype == dtype
    assert loaded.engine.spec == original.engine.spec
    assert np.array_equal(loaded.score(tokens), original.score(tokens))


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_uses_llama_cpp_architecture_tensor_names_and_row_order(variant, model_dirs, exported):
    metadata, tensors = read_gguf(exported[variant, "float32"])
    arch = metadata["general.architecture"]
    assert arch == variant
    n_layers = metadata[f"{arch}.block_count"]
    kinds = gguf.MODEL_TENSORS[gguf.MODEL_ARCH[arch.upper()]]
    known = {gguf.TENSOR_NAMES[t].format(bid=i) + suffix for t in kinds for i in range(n_layers)
             for suffix in (".weight", ".bias")}
    assert set(tensors) <= known
    # q rows: Hugging Face's order, interleaved per head for llama.cpp's normal rope
    hf = hf_tensors(model_dirs[variant])
    n_head, q_size = metadata[f"{arch}.attention.head_count"], tensors["blk.1.attn_output.weight"].shape[1]
    p = "model.layers.1.self_attn."
    hf_q = hf.get(p + "q_proj.weight", hf.get(p + "qkv_proj.weight"))
    q = tensors.get("blk.1.attn_q.weight", tensors.get("blk.1.attn_qkv.weight")).value.data[:q_size]
    expected = permute(hf_q[:q_size], n_head, n_head) if variant in NORM_ROPE else hf_q[:q_size]
    assert np.array_equal(q, expected)


def test_family_specific_tensors_and_keys(exported, model_dirs):
    _, phi3 = read_gguf(exported["phi3", "q8_0"])
    assert phi3["blk.0.attn_qkv.weight"].shape == (64 + 2 * 32, 64)
    assert phi3["blk.0.ffn_up.weight"].shape == (2 * 96, 64) and "blk.0.ffn_gate.weight" not in phi3
    assert phi3["rope_factors_long.weight"].shape == phi3["rope_factors_short.weight"].shape == (6,)
    meta, _ = read_gguf(exported["phi3", "q8_0"])
    assert meta["phi3.rope.dimension_count"] == 12 and meta["phi3.rope.scaling.original_context_length"] == 32
    meta, _ = read_gguf(exported["granite", "q8_0"])
    assert [meta[f"granite.{k}"] for k in ("embedding_scale", "residual_scale", "logit_scale")] == \
        pytest.approx([6.0, 0.4, 3.0])
    assert meta["granite.attention.scale"] == pytest.approx(0.2)
    meta, qwen2 = read_gguf(exported["qwen2", "q8_0"])
    hf = hf_tensors(model_dirs["qwen2"])
    bias = hf["model.layers.0.self_attn.k_proj.bias"]
    assert np.array_equal(qwen2["blk.0.attn_k.bias"].value.data[0], bias)
    meta, gemma2 = read_gguf(exported["gemma2", "float32"])
    assert meta["gemma2.attn_logit_softcapping"] == 2.0 and meta["gemma2.final_logit_softcapping"] == 3.0
    assert meta["gemma2.attention.sliding_window"] == 8
    hf = hf_tensors(model_dirs["gemma2"])  # Gemma's norms stored with the + 1, as convert_hf_to_gguf does
    assert np.array_equal(gemma2["blk.0.post_ffw_norm.weight"].value.data[0],
                          hf["model.layers.0.post_feedforward_layernorm.weight"] + np.float32(1.0))
    meta, _ = read_gguf(exported["gemma3", "float32"])
    assert meta["gemma3.rope.freq_base"] == 1e6 and meta["gemma3.rope.freq_base_swa"] == 1e4
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    meta, _ = read_gguf(exported["olmo2", "float32"])
    assert "numaserve.spec" not in meta  # llama.cpp's keys say it all


@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_keys_alone_load_every_family_but_smollm3s_rope_layout(variant, model_dirs, exported,
                                                                         monkeypatch):
    # Without numaserve.spec only float32 rounding of keys and rope factors remains, except SmolLM3, whose
    # rope-less layers llama.cpp fixes at every 4th (this checkpoint's second layer has none)
    tokens = random_prompt(70, seed=8)
    exact = make_llm(model_dirs[variant], "float32").score(tokens)
    monkeypatch.setattr(models.gguf.model_spec, "SPEC_KEY", "numaserve.not-read")
    llama_cpp_view = make_llm(exported[variant, "float32"]).score(tokens)
    if variant == "smollm3":
        assert np.abs(llama_cpp_view - exact).max() > 0.1
    else:
        np.testing.assert_allclose(llama_cpp_view, exact, atol=1e-4, rtol=0)


def test_mistral_exports_as_llama_with_its_sliding_window(model_dirs, tmp_path):
    path = convert_to_gguf(model_dirs["mistral"], tmp_path / "mistral.gguf", "q8_0")
    metadata, _ = read_gguf(path)
    assert metadata["general.architecture"] == "llama"  # convert_hf_to_gguf's LlamaModel
    assert metadata["llama.attention.sliding_window"] == 8  # llama.cpp's llama ignores it; numaserve does not
    tokens = random_prompt(40, seed=9)
    loaded, original = make_llm(path), make_llm(model_dirs["mistral"], "q8_0")
    assert loaded.engine.spec == original.engine.spec
    assert np.array_equal(loaded.score(tokens), original.score(tokens))


@pytest.mark.parametrize("variant", ["phi3", "gemma3", "qwen2"])
def test_reexport_of_a_loaded_gguf_keeps_every_tensor_and_key(variant, exported, tmp_path):
    first = exported[variant, "q8_0"]
    again = convert_to_gguf(first, tmp_path / "again.gguf", "q8_0")
    (meta_a, tensors_a), (meta_b, tensors_b) = read_gguf(first), read_gguf(again)
    assert {k: v for k, v in meta_a.items() if k != "general.name"} == \
        {k: v for k, v in meta_b.items() if k != "general.name"}
    assert tensors_a.keys() == tensors_b.keys()
    for name, a in tensors_a.items():
        b = tensors_b[name]
        assert a.ggml_type == b.ggml_type and np.array_equal(a.value.data, b.value.data), name


# ---- files written the way convert_hf_to_gguf.py writes them ---------------------------------------------

@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_gguf_matches_transformers(variant, reference_dirs, tmp_path):
    path = reference_gguf(reference_dirs[variant], tmp_path / f"{variant}.gguf")
    hf = AutoModelForCausalLM.from_pretrained(reference_dirs[variant], dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tokens = random_prompt(70, seed=5)  # Phi-3: past its original 32 positions, its long factors
    ours = make_llm(path, "float32").score(tokens)
    np.testing.assert_allclose(ours, hf_logits(hf, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_reference_q8_0_gguf_keeps_its_blocks(variant, reference_dirs, tmp_path):
    # gguf.quants quantizes as numaserve does: the file's blocks, un-permuted and stacked, are the
    # checkpoint's quantized by numaserve at load time
    path = reference_gguf(reference_dirs[variant], tmp_path / f"{variant}.gguf", GT.Q8_0)
    tokens = random_prompt(40, seed=6)
    ours = make_llm(path)
    assert ours.engine.model.weight_dtype == "q8_0"
    assert np.array_equal(ours.score(tokens), make_llm(reference_dirs[variant], "q8_0").score(tokens))


# ---- bad input -------------------------------------------------------------------------------------------

BAD_FILES = {
    "architecture": ("qwen2", {"metadata": {"general.architecture": ("gpt2", GGUFValueType.STRING)}},
                     ("general.architecture='gpt2' is not supported; numaserve loads GGUF files of 'llama', "
                      "'qwen2', 'qwen3', 'gemma2', 'gemma3', 'phi3', 'granite', 'olmo2', 'smollm3'")),
    "missing_bias": ("qwen2", {"drop": ["blk.1.attn_v.bias"]}, "'blk.1.attn_v.bias' is missing"),
    "missing_qk_norm": ("qwen3", {"drop": ["blk.0.attn_k_norm.weight"]},
                        "'blk.0.attn_k_norm.weight' is missing"),
    "fused_shape": ("phi3", {"metadata": {"phi3.feed_forward_length": (80, GGUFValueType.UINT32)}},
                    "'blk.0.ffn_up.weight' has shape \\(192, 64\\), expected \\(160, 64\\)"),
    "longrope_half": ("phi3", {"drop": ["rope_factors_short.weight"]}, "needs both rope_factors_long"),
    "window_pattern": ("gemma2", {"metadata": {"gemma2.attention.sliding_window_pattern": (
        [True], GGUFValueType.ARRAY)}}, "sliding_window_pattern has 1 entries for 2 layers"),
    "spec_json": ("gemma2", {"metadata": {"numaserve.spec": ("{not json", GGUFValueType.STRING)}},
                  "metadata is inconsistent"),
    "spec_field": ("gemma2", {"metadata": {"numaserve.spec": ('{"hidden": 3}', GGUFValueType.STRING)}},
                   "not a JSON object of ModelSpec fields"),
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_bad_gguf_raises_checkpoint_error_naming_the_problem(case, model_dirs, tmp_path):
    variant, edits, message = BAD_FILES[case]
    path = reference_gguf(model_dirs[variant], tmp_path / f"{case}.gguf", **edits)
    with pytest.raises(CheckpointError, match=message) as e:
        make_llm(path)
    assert str(path) in str(e.value)


# ---- llama.cpp (the optional bench extra) ------------------------------------------------------------------

# What llama.cpp's F32 logits differ from ours by on the reference checkpoints (a wrong rope layout, bias,
# norm placement or multiplier moves them by more than 0.1): float32 rounding, except Gemma's GELU, which
# llama.cpp's CPU backend reads from a float16 table (GGML_GELU_FP16; measured 1.3e-3 on Gemma 2, 2.6e-3 on
# Gemma 3).
LLAMA_CPP_TOLERANCE = {"gemma2": 1e-2, "gemma3": 1e-2}


@needs_llama_cpp
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_runs_our_export_with_matching_logits(variant, reference_dirs, tmp_path):
    # not the directory's name: llama.cpp expects a model named like Phi-3 to have its <|end|> token
    spec, weights, tokenizer = load_model(reference_dirs[variant], "float32")
    path = export_gguf(spec, weights, tokenizer, tmp_path / "m.gguf", name="test model")
    tokens = random_prompt(60, seed=7)  # Phi-3: llama.cpp's context (padded to 256) takes the long factors
    llm = llama_cpp(path, n_ctx=64, logits_all=True, type_k=0, type_v=0)
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:len(tokens)], np.float32)
    ours = make_llm(reference_dirs[variant], "float32").score(tokens)
    assert np.abs(theirs - ours).max() < LLAMA_CPP_TOLERANCE.get(variant, 1e-4)
