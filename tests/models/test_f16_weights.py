"""float16 weights served as they are: the kernel equals float32 weights of the same values bit for bit at
every batch size, the matrix helpers keep the bits, and an engine over a float16 checkpoint keeps its bits
and gives the float32 engine's logits exactly (LoRA and speculation included). GGUF F16 files:
tests/models/test_gguf.py."""

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import numaserve as ns
from cluster_configs.errors import CheckpointError
from memory.matrices import WeightMatrix, row_block, select_rows
from models.linear import dequantize, embed, linear
from models.quantization.activation_plan import linear_matrices
from tests.conftest import random_prompt
from tests.models.test_lora import make_adapter

F32_KV = {"kv_dtype": "float32", "max_model_len": 128}


def f16_values(n: int, k: int, seed: int = 0) -> np.ndarray:
    """[n, k] float16 with the awkward values: subnormals, zeros of both signs, the largest finite."""
    w = (np.random.default_rng(seed).standard_normal((n, k)) * 0.5).astype(np.float16)
    w[0, :4] = [np.float16(6e-8), np.float16(-6e-5), np.float16(-0.0), np.float16(65504)]
    return w


# 100: not a multiple of the 32-column group (a column tail); 2087 as
# tests/scheduling/test_batch_invariance.py
@pytest.mark.parametrize("k", [100, 256, 2087])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 17])
def test_float16_linear_equals_float32_weights_of_the_same_values_bit_for_bit(k, num_tokens):
    w16 = f16_values(37, k)  # 37 rows: a tail of row groups
    x = np.random.default_rng(num_tokens).standard_normal((num_tokens, k)).astype(np.float32)
    got = linear(x, WeightMatrix("float16", w16))
    assert np.array_equal(got, linear(x, WeightMatrix("float32", w16.astype(np.float32))))
    # and it is the product: float32 accumulation over K terms, error <= K * eps32 * sum|x * w|
    w64 = w16.astype(np.float64)
    bound = k * np.finfo(np.float32).eps * (np.abs(x).astype(np.float64) @ np.abs(w64).T)
    assert np.all(np.abs(got - x.astype(np.float64) @ w64.T) <= bound)


def test_float16_matrix_helpers_keep_the_bits():
    w16 = f16_values(12, 100)
    w = WeightMatrix("float16", w16)
    assert w.shape == (12, 100) and w.nbytes == 12 * 100 * 2
    assert np.array_equal(dequantize(w), w16.astype(np.float32))
    ids = np.array([5, 0, 11, 5])
    assert np.array_equal(embed(w, ids), w16[ids].astype(np.float32))
    rows = select_rows(w, ids)
    assert rows.dtype == "float16" and np.array_equal(rows.data.view(np.uint16), w16[ids].view(np.uint16))
    block = row_block(w, 4, 8)
    assert block.dtype == "float16" and np.shares_memory(block.data, w16)
    assert np.array_equal(block.data.view(np.uint16), w16[4:8].view(np.uint16))


def test_from_float_rounds_to_nearest_even_and_keeps_float16_values():
    w16 = f16_values(8, 64)
    assert np.array_equal(WeightMatrix.from_float(w16.astype(np.float32), "float16").data.view(np.uint16),
                          w16.view(np.uint16))
    w = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32)
    w[0, :4] = [1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 65519.0, -np.inf]  # ties to even (down, up), max, inf
    got = WeightMatrix.from_float(w, "float16").data
    assert got.dtype == np.float16
    assert np.array_equal(got.view(np.uint16), w.astype(np.float16).view(np.uint16))
    assert got[0, 0] == 1 and got[0, 1] == 1 + 2.0 ** -9 and got[0, 2] == 65504 and got[0, 3] == -np.inf


def test_a_finite_weight_beyond_float16s_range_is_refused():
    w = np.ones((4, 32), np.float32)
    w[2, 7] = -65520.0  # rounds past the largest float16
    with pytest.raises(CheckpointError, match="65520 exceeds float16's largest value"):
        WeightMatrix.from_float(w, "float16")


@pytest.fixture(scope="module")
def f16_dirs(model_dirs, tmp_path_factory) -> dict:
    """variant -> the test model as a float16 checkpoint (F16 safetensors, as a torch_dtype float16 model is
    saved)."""
    root = tmp_path_factory.mktemp("f16")
    for variant in ("llama", "qwen3_moe"):
        shutil.copytree(model_dirs[variant], root / variant)
        for f in (root / variant).glob("*.safetensors"):
            save_file({k: v.astype(np.float16) for k, v in load_file(f).items()}, f)
    return {variant: root / variant for variant in ("llama", "qwen3_moe")}


@pytest.fixture(scope="module")
def f16_dir(f16_dirs):
    return f16_dirs["llama"]


@pytest.mark.parametrize("variant", ["llama", "qwen3_moe"])  # a MoE's experts too (row blocks of one matrix)
def test_a_float16_checkpoint_keeps_its_bits_and_gives_the_float32_engines_logits(f16_dirs, variant):
    f16_dir = f16_dirs[variant]
    llm16 = ns.LLM(f16_dir, weight_dtype="float16", **F32_KV)
    llm32 = ns.LLM(f16_dir, weight_dtype="float32", **F32_KV)
    tensors = {k: v for f in f16_dir.glob("*.safetensors") for k, v in load_file(f).items()}
    qkv = llm16.engine.model.weights.layers[0].qkv
    assert isinstance(qkv, WeightMatrix)  # auto: float32 activations, unpacked
    assert {w.dtype for _, _, w in linear_matrices(llm16.engine.model.weights)} == {"float16"}
    file_qkv = np.concatenate([tensors[f"model.layers.0.self_attn.{m}_proj.weight"] for m in "qkv"])
    assert np.array_equal(qkv.data.view(np.uint16), file_qkv.view(np.uint16))
    embedding = llm16.engine.model.weights.embed
    assert np.array_equal(embedding.data.view(np.uint16),
                          tensors["model.embed_tokens.weight"].view(np.uint16))
    assert {d["choice"] for d in llm16.diagnostics() if d["topic"] == "activation_dtype"} == {"float32"}
    tokens = random_prompt(40, seed=8)
    assert np.array_equal(llm16.score(tokens), llm32.score(tokens))
    params = ns.SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert llm16.generate(tokens, params)[0].token_ids == llm32.generate(tokens, params)[0].token_ids


@pytest.mark.parametrize("merge", ["never", "always"])
def test_lora_on_float16_weights(f16_dir, tmp_path, merge):
    # low-rank: the adapter's slots are float32 (models/lora/slots.py), so it equals the float32 engine's bit
    # for bit; merged: each adapted matrix is rounded back to float16 (about 2^-11 of each value)
    adapter = make_adapter(f16_dir, tmp_path / "a", seed=1)
    tokens = random_prompt(30, seed=9)
    logits = {}
    for dtype in ("float16", "float32"):
        llm = ns.LLM(f16_dir, weight_dtype=dtype, lora_merge=merge, **F32_KV)
        llm.register_adapter("a", adapter)
        logits[dtype] = llm.score(tokens, adapter="a")
        assert llm.stats()["num_merged_tokens"] == (30 if merge == "always" else 0)
        base = llm.score(tokens)
    assert np.abs(logits["float32"] - base).max() > 0.1  # the adapter does change the logits
    if merge == "never":
        assert np.array_equal(logits["float16"], logits["float32"])
    else:
        assert np.abs(logits["float16"] - logits["float32"]).max() < 0.01


def test_greedy_speculation_on_float16_weights_gives_the_tokens_of_none(f16_dir):
    prompt = random_prompt(8, seed=10) * 4  # repeats: n-gram drafts
    params = ns.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = ns.LLM(f16_dir, weight_dtype="float16", **F32_KV)
    speculation = {"method": "ngram", "num_speculative_tokens": 3, "mode": "on"}
    spec = ns.LLM(f16_dir, weight_dtype="float16", speculation=speculation, **F32_KV)
    assert spec.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
    assert spec.stats()["spec_num_draft_tokens"] > 0
