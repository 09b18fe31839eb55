"""GGUF files with K-quants as people download them: a Q4_K_M file made by llama.cpp's own quantizer
(tests/fixtures/make_kquant_gguf.py) loads with every tensor in its stored type, and numaserve's float32
logits equal transformers' over the gguf package's dequantization of the same file."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from transformers import LlamaConfig, LlamaForCausalLM

import numaserve as ns
from cluster_configs.diagnostics import DecisionLog
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from kernels.simd.vnni import VNNI_FEATURES
from memory.block_matrices import uses_vnni
from memory.matrices import StackedMatrix, host_has_vnni, parts
from models.gguf.format import rope_row_order
from models.gguf.writer import convert_to_gguf
from models.linear import dequantize, linear
from models.loader import load_model
from models.quantization.activation_plan import linear_matrices, plan_activations
from tests.conftest import random_prompt
from tests.fixtures.make_kquant_gguf import FIXTURE, OVERRIDES, SEED
from tests.models.test_gguf import reference_gguf
from tests.support.model_factory import COMMON, VARIANTS, build_model

# llama.cpp's Q4_K_M choices for the fixture's 4 layers (layers 2 and 3 get more bits) and its fallbacks for
# ffn_down's 288-value rows
EXPECTED_TYPES = {"token_embd.weight": GT.Q4_K, "output.weight": GT.Q6_K,
                  **{f"blk.{i}.{name}.weight": GT.Q4_K for i in range(4)
                     for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
                  **{f"blk.{i}.attn_v.weight": GT.Q6_K if i >= 2 else GT.Q4_K for i in range(4)},
                  **{f"blk.{i}.ffn_down.weight": GT.Q8_0 if i >= 2 else GT.Q5_0 for i in range(4)}}
HF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm"}


def config(overrides: dict = OVERRIDES) -> LlamaConfig:
    return VARIANTS["llama"][0](**(COMMON | VARIANTS["llama"][2] | overrides))


def dequantized_checkpoint(path: Path, cfg: LlamaConfig | None = None) -> dict[str, torch.Tensor]:
    """The file's tensors through gguf.quants.dequantize, under Hugging Face names and row order."""
    cfg = cfg or config()
    state = {}
    for t in gguf.GGUFReader(path).tensors:
        if t.name == "rope_freqs.weight":
            continue  # transformers computes the llama3 frequencies from the config
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        if t.name in ("token_embd.weight", "output.weight", "output_norm.weight"):
            name = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                    "output_norm.weight": "model.norm.weight"}[t.name]
        else:
            _, layer, kind, _ = t.name.split(".")
            name = f"model.layers.{layer}.{HF_NAMES[kind]}.weight"
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(kind)
            if heads:  # convert_hf_to_gguf's rope permutation, undone
                restored = np.empty_like(values)
                restored[rope_row_order(heads, cfg.head_dim)] = values
                values = restored
        state[name] = torch.from_numpy(values)
    return state


@pytest.fixture(scope="module")
def reference() -> LlamaForCausalLM:
    """transformers in float64: at this width (256) its float32 logits are 9e-5 from float64's, ours 7e-5."""
    model = LlamaForCausalLM(config()).eval()
    missing, unexpected = model.load_state_dict(dequantized_checkpoint(FIXTURE), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    return model.double()


def test_fixture_holds_llama_cpps_q4_k_m_mix():
    stored = {t.name: t.tensor_type for t in gguf.GGUFReader(FIXTURE).tensors if t.data.ndim == 2}
    assert stored == EXPECTED_TYPES


def test_every_tensor_is_served_in_its_stored_type():
    _, weights, _ = load_model(FIXTURE, "auto")
    assert weights.embed.dtype == "q4_k" and weights.lm_head.dtype == "q6_k"
    for i, layer in enumerate(weights.layers):
        more_bits = i >= 2
        assert isinstance(layer.qkv, StackedMatrix) == more_bits  # q, k in Q4_K; v in Q6_K
        assert [p.dtype for p in parts(layer.qkv)] == (["q4_k", "q6_k"] if more_bits else ["q4_k"])
        assert (layer.o.dtype, layer.gate_up.dtype) == ("q4_k", "q4_k")
        assert layer.down.dtype == ("q8_0" if more_bits else "q5_0")


def test_float32_logits_equal_transformers_over_the_dequantized_file(reference):
    tokens = random_prompt(40, seed=3)
    llm = ns.LLM(FIXTURE, activation_dtype="float32", kv_dtype="float32", max_model_len=128, max_num_seqs=1)
    with torch.no_grad():
        exact = reference(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(llm.score(tokens), exact, atol=1e-4, rtol=0)


def test_our_q4_k_m_of_the_f16_file_is_llama_cpps_byte_for_byte(tmp_path):
    # the fixture's own source, rebuilt: the same random model (seeded) exported to F16 the same way
    build_model(tmp_path / "hf", "llama", seed=SEED, **OVERRIDES)
    f16 = reference_gguf(tmp_path / "hf", tmp_path / "f16.gguf")
    assert_same_tensors(convert_to_gguf(f16, tmp_path / "ours.gguf", "q4_k_m"), FIXTURE)


def assert_same_tensors(ours: Path, theirs: Path) -> None:
    """Two GGUF files hold the same tensors, each of the same type and bytes (the llama3 rope frequencies,
    recomputed from the scaling read back, within float32 rounding)."""
    expected = {t.name: t for t in gguf.GGUFReader(theirs).tensors}
    mine = {t.name: t for t in gguf.GGUFReader(ours).tensors}
    assert mine.keys() == expected.keys()
    for name, t in expected.items():
        assert mine[name].tensor_type == t.tensor_type, name
        if name == "rope_freqs.weight":
            np.testing.assert_allclose(mine[name].data, t.data, rtol=1e-6)
        else:
            assert np.array_equal(mine[name].data, t.data), name


# the K-quant, Q6_K and q8_0 int8 kernels: AVX-512 VNNI's where the CPU has it, else AVX2's (the same bits);
# without AVX2 the matrices keep float32 activations
needs_int8_kernels = pytest.mark.skipif(bool(missing_features(AVX2_FEATURES)), reason="this CPU lacks AVX2")
needs_vnni_kernels = pytest.mark.skipif(bool(missing_features(VNNI_FEATURES)),  # IQ4's int8 kernel
                                        reason="this CPU lacks AVX512-VNNI")
INT8 = {"activation_dtype": "int8", "kv_dtype": "float32", "max_model_len": 128}


def kernel_paths() -> tuple[str, ...]:
    """The kernel each of the fixture's formats runs with int8 activations on this host, as pack chooses."""
    def block(kernel: str, dtype: str) -> str:
        return f"{kernel}{'' if uses_vnni(dtype) else '_avx2'}: {dtype}"

    return (block("matmul_kquant", "q4_k"), block("matmul_q6k", "q6_k"), block("matmul_kquant", "q5_0"),
            f"{'matmul_vnni' if host_has_vnni() else 'matmul_int8'}: q8_0")


def kernels_of(llm) -> str:
    return " ".join(d["choice"] + d["reason"] for d in llm.diagnostics() if d["topic"] == "kernel")


@needs_int8_kernels
def test_int8_activations_run_every_format_through_its_int8_kernel():
    llm = ns.LLM(FIXTURE, **INT8)
    kernels = kernels_of(llm)
    for path in kernel_paths():
        assert f"{path} weights x int8 activations" in kernels
    assert "float32 activations" not in kernels


@needs_int8_kernels
def test_hiding_vnni_serves_the_same_logits_through_the_avx2_kernels(monkeypatch):
    # where the CPU has VNNI this runs the AVX2 kernels of a whole model beside them; elsewhere both runs are
    # AVX2's
    tokens = random_prompt(40, seed=5)
    monkeypatch.delenv("NUMASERVE_DISABLE_CPU_FEATURES", raising=False)
    logits = ns.LLM(FIXTURE, **INT8).score(tokens)
    monkeypatch.setenv("NUMASERVE_DISABLE_CPU_FEATURES", "avx512vnni")
    hidden = ns.LLM(FIXTURE, **INT8)
    kernels = kernels_of(hidden)
    for path in ("matmul_kquant_avx2: q4_k", "matmul_q6k_avx2: q6_k", "matmul_kquant_avx2: q5_0",
                 "matmul_int8: q8_0"):
        assert f"{path} weights x int8 activations" in kernels
    np.testing.assert_array_equal(hidden.score(tokens), logits)


@needs_int8_kernels
def test_every_packed_matrix_of_the_file_equals_float64_over_the_same_quantized_activations():
    assert_packed_matrices_equal_float64(FIXTURE)


def assert_packed_matrices_equal_float64(path) -> None:
    """Every matrix of the file packed for int8 activations equals float64 over the same quantized
    activations (and the file's own dequantized weights) within 1e-6 of the output's scale."""
    _, weights, _ = load_model(path, "auto")
    packed = plan_activations(weights, "int8", DecisionLog())
    rng = np.random.default_rng(0)
    for (name, _, stored), (_, _, served) in zip(linear_matrices(weights), linear_matrices(packed)):
        x = rng.standard_normal((3, stored.shape[1])).astype(np.float32)
        blocks = x.reshape(3, -1, 32)  # quantized per 32 values as kernels/formats/int8_layout.py does
        d = np.abs(blocks).max(-1, keepdims=True) / np.float32(127)
        rounded = (np.rint(blocks * (1 / d)) * d).reshape(x.shape).astype(np.float64)
        reference = rounded @ dequantize(stored).astype(np.float64).T
        error = np.abs(linear(x, served) - reference).max() / np.abs(reference).max()
        assert error < 1e-6, name
