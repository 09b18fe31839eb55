"""IQ4_NL and IQ4_XS, the 4-bit non-linear GGUF types people download: files made by llama.cpp's own
quantizer (tests/fixtures/make_iq4_gguf.py) load with every tensor in its stored type, numaserve's float32
logits equal transformers' (float64) over the gguf package's dequantization of the same file, with int8
activations every matrix runs the VNNI kernel and equals float64 over the same quantized activations, and
quantizing the F16 source to iq4_nl / iq4_xs (at load and at export) gives llama.cpp's bytes."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from transformers import LlamaForCausalLM

import numaserve as ns
from cluster_configs.errors import CheckpointError
from memory.matrices import WeightMatrix, parts
from models.gguf.writer import convert_to_gguf
from models.linear import dequantize
from models.loader import load_model
from tests.conftest import random_prompt
from tests.fixtures.make_iq4_gguf import FIXTURES, IQ4_OVERRIDES
from tests.fixtures.make_kquant_gguf import OVERRIDES, SEED
from tests.models.test_gguf import reference_gguf
from tests.models.test_kquant_gguf import (
    assert_packed_matrices_equal_float64,
    assert_same_tensors,
    config,
    dequantized_checkpoint,
    needs_vnni_kernels,
)
from tests.support.model_factory import build_model

DTYPES = tuple(FIXTURES)


@pytest.fixture(scope="module")
def f16(tmp_path_factory):
    """The fixtures' source: the same seeded model exported to F16 as their generator did."""
    tmp = tmp_path_factory.mktemp("iq4-source")
    build_model(tmp / "hf", "llama", seed=SEED, **(OVERRIDES | IQ4_OVERRIDES))
    return reference_gguf(tmp / "hf", tmp / "f16.gguf")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_tensor_is_served_in_its_stored_type(dtype):
    _, weights, _ = load_model(FIXTURES[dtype], "auto")
    assert weights.embed.dtype == dtype and weights.lm_head.dtype == "q6_k"
    for layer in weights.layers:
        assert [p.dtype for p in parts(layer.qkv)] == [dtype, "q5_k"]  # q, k; v (4 query heads per KV head)
        assert {layer.o.dtype, layer.gate_up.dtype} == {dtype}
        assert layer.down.dtype == "iq4_nl"  # 288-value rows: IQ4_XS falls back to IQ4_NL, as llama.cpp


@pytest.mark.parametrize("dtype", DTYPES)
def test_float32_logits_equal_transformers_over_the_dequantized_file(dtype):
    cfg = config(OVERRIDES | IQ4_OVERRIDES)
    model = LlamaForCausalLM(cfg).eval()
    missing, unexpected = model.load_state_dict(dequantized_checkpoint(FIXTURES[dtype], cfg), strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    tokens = random_prompt(40, seed=4)
    llm = ns.LLM(FIXTURES[dtype], activation_dtype="float32", kv_dtype="float32", max_model_len=128,
                 max_num_seqs=1)
    with torch.no_grad():
        exact = model.double()(torch.tensor([tokens])).logits[0].numpy()
    np.testing.assert_allclose(llm.score(tokens), exact, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_our_iq4_of_the_f16_file_is_llama_cpps_byte_for_byte(dtype, f16, tmp_path):
    assert_same_tensors(convert_to_gguf(f16, tmp_path / "ours.gguf", dtype), FIXTURES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantization_equals_the_gguf_packages(dtype):
    rng = np.random.default_rng(1)
    w = (rng.standard_t(3, (40, 512)) * 10.0 ** rng.uniform(-4, 1, (40, 1))).astype(np.float32)
    w[3] = 0.0
    m = WeightMatrix.from_float(w, dtype)
    assert np.array_equal(dequantize(m), gguf.quants.dequantize(m.data, GT[dtype.upper()]))


def test_other_i_quants_stay_refused_by_name(tmp_path, f16):
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python (the bench extra) makes the file")
    from tests.fixtures.make_kquant_gguf import quantize

    path = tmp_path / "iq3.gguf"
    quantize(f16, path, llama_cpp.LLAMA_FTYPE_MOSTLY_IQ3_S)
    with pytest.raises(CheckpointError, match="IQ3_S, an I-quant"):
        load_model(path, "auto")


@needs_vnni_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_activations_run_the_iq4_matrices_through_the_vnni_kernel(dtype):
    llm = ns.LLM(FIXTURES[dtype], activation_dtype="int8", kv_dtype="float32", max_model_len=128)
    kernels = " ".join(d["choice"] + d["reason"] for d in llm.diagnostics() if d["topic"] == "kernel")
    assert f"matmul_kquant: {dtype} weights x int8 activations" in kernels
    assert "float32 activations" not in kernels


@needs_vnni_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_packed_iq4_matrix_equals_float64_over_the_same_quantized_activations(dtype):
    assert_packed_matrices_equal_float64(FIXTURES[dtype])
