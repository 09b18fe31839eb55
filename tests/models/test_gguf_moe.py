"""Mixture-of-experts GGUF files: Qwen3-MoE as llama.cpp's `qwen3moe`, Mixtral as `llama` with experts, the
experts in llama.cpp's merged tensors (ffn_gate_exps / ffn_up_exps [E, I, hidden], ffn_down_exps
[E, hidden, I], the router ffn_gate_inp [E, hidden] in F32). Export then load is exact; a file written the way
convert_hf_to_gguf.py writes one (the gguf package, in this file) loads to transformers' logits; llama.cpp
runs our exports (when installed)."""

import json

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GT

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

VARIANTS = ("qwen3_moe", "mixtral")
DTYPES = ("float32", "bfloat16", "q8_0", "q4_0")
# what llama.cpp's files can say: every layer with experts, the top-k weights renormalised, no window
REFERENCE = {"qwen3_moe": {"mlp_only_layers": [], "norm_topk_prob": True},
             "mixtral": {"sliding_window": None}}


@pytest.fixture(scope="module")
def exported(model_dirs, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_export")
    return {(v, dt): convert_to_gguf(model_dirs[v], root / f"{v}-{dt}.gguf", dt)
            for v in VARIANTS for dt in DTYPES}


@pytest.fixture(scope="module")
def reference_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe_reference")
    for variant, overrides in REFERENCE.items():
        build_model(root / variant, variant, **overrides)
    return {v: root / v for v in REFERENCE}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_export_then_load_gives_identical_logits(variant, dtype, model_dirs, exported):
    # the test variants' dense first layer and unnormalised routing (qwen3_moe) ride in numaserve.spec
    tokens = random_prompt(50, seed=3)
    original = make_llm(model_dirs[variant], dtype)
    loaded = make_llm(exported[variant, dtype])
    assert loaded.engine.spec == original.engine.spec
    assert np.array_equal(loaded.score(tokens), original.score(tokens))


@pytest.mark.parametrize("variant", VARIANTS)
def test_experts_are_llama_cpps_merged_tensors(variant, reference_dirs, tmp_path):
    spec, weights, tokenizer = load_model(reference_dirs[variant], "q8_0")
    path = export_gguf(spec, weights, tokenizer, tmp_path / "m.gguf")
    metadata, tensors = read_gguf(path)
    arch = metadata["general.architecture"]
    assert arch == {"qwen3_moe": "qwen3moe", "mixtral": "llama"}[variant]
    E, k, I, h = spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size, spec.hidden_size
    assert (metadata[f"{arch}.expert_count"], metadata[f"{arch}.expert_used_count"]) == (E, k)
    assert "numaserve.spec" not in metadata  # llama.cpp's keys say it all
    known = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], spec.num_layers)
    for name, shape, kind in (("ffn_gate_inp", (E, h), GT.F32), ("ffn_gate_exps", (E, I, h), GT.Q8_0),
                              ("ffn_up_exps", (E, I, h), GT.Q8_0), ("ffn_down_exps", (E, h, I), GT.Q8_0)):
        t = tensors[f"blk.1.{name}.weight"]
        assert (t.shape, t.ggml_type) == (shape, kind)
        assert known.get_name(f"blk.1.{name}") == f"blk.1.{name}"  # a name gguf-py knows for this arch
    assert not any(".ffn_gate.weight" in n or ".ffn_up.weight" in n for n in tensors)


def reference_moe_gguf(model_dir, out, ftype: GT):
    """A MoE GGUF as convert_hf_to_gguf.py writes one (Qwen3MoeModel, MixtralModel = LlamaModel): the
    family's keys, q/k rows permuted for llama's rope, each layer's experts stacked into the merged tensors,
    matrices in ftype, the router and vectors F32."""
    cfg = json.loads((model_dir / "config.json").read_text())
    moe = cfg["architectures"][0] == "Qwen3MoeForCausalLM"
    arch = "qwen3moe" if moe else "llama"
    n_layers, n_head, n_kv = cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head
    E = cfg.get("num_experts") or cfg["num_local_experts"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(n_layers)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if moe:
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    add_gpt2_vocab(w, model_dir, cfg["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    block, (gate, up, down) = (("mlp", ("gate_proj", "up_proj", "down_proj")) if moe
                               else ("block_sparse_moe", ("w1", "w3", "w2")))
    hf = hf_tensors(model_dir)

    def add(name, data):
        if data.ndim == 1 or ftype == GT.F32 or name.endswith("ffn_gate_inp.weight"):
            w.add_tensor(name, data.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), ftype), raw_dtype=ftype)

    for hf_name, data in hf.items():
        if ".experts." in hf_name:
            continue
        if not moe and ".q_proj." in hf_name:
            data = permute(data, n_head, n_head)
        if not moe and ".k_proj." in hf_name:
            data = permute(data, n_head, n_kv)
        add(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data)
    for i in range(n_layers):
        for proj, gguf_name in ((gate, "ffn_gate_exps"), (up, "ffn_up_exps"), (down, "ffn_down_exps")):
            stacked = np.stack([hf[f"model.layers.{i}.{block}.experts.{e}.{proj}.weight"] for e in range(E)])
            add(f"blk.{i}.{gguf_name}.weight", stacked)
    return finish_gguf(w, out)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_converter_style_gguf_loads_to_transformers_logits(variant, reference_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    path = reference_moe_gguf(reference_dirs[variant], tmp_path / "ref.gguf", GT.F32)
    tokens = random_prompt(40, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(reference_dirs[variant], dtype="float32",
                                              attn_implementation="eager").eval()
    np.testing.assert_allclose(make_llm(path, "float32").score(tokens), hf_logits(hf, tokens), atol=1e-4,
                               rtol=0)
    # its Q8_0 expert blocks are the bytes we quantize to at load time
    q8 = reference_moe_gguf(reference_dirs[variant], tmp_path / "ref-q8.gguf", GT.Q8_0)
    assert np.array_equal(make_llm(q8).score(tokens), make_llm(reference_dirs[variant], "q8_0").score(tokens))


def test_experts_in_a_family_without_them_are_refused(model_dirs, tmp_path):
    from tests.models.test_gguf_families import reference_gguf

    bad = reference_gguf(model_dirs["qwen3"], tmp_path / "bad.gguf",
                         metadata={"qwen3.expert_count": (4, gguf.GGUFValueType.UINT32)})
    with pytest.raises(CheckpointError, match="expert_count=4.*qwen3moe and of llama"):
        make_llm(bad)


@needs_llama_cpp
@pytest.mark.parametrize("variant", VARIANTS)
def test_llama_cpp_runs_our_moe_export_with_matching_logits(variant, reference_dirs, tmp_path):
    spec, weights, tokenizer = load_model(reference_dirs[variant], "float32")
    path = export_gguf(spec, weights, tokenizer, tmp_path / "m.gguf", name="test model")
    tokens = random_prompt(60, seed=7)
    llm = llama_cpp(path, n_ctx=64, logits_all=True, type_k=0, type_v=0)
    llm.eval(tokens)
    theirs = np.asarray(llm.scores[:len(tokens)], np.float32)
    ours = make_llm(reference_dirs[variant], "float32").score(tokens)
    assert np.abs(theirs - ours).max() < 1e-4
