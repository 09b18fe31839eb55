"""A tensor-parallel rank's part of a GGUF file, read directly from it: each matrix and vector it holds is,
bit for bit, its slices of what the whole file loads to (the slices the Hugging Face names are cut by:
models/tensor_parallel/shard.py), in the file's own formats (float, Q8_0's blocks, the K-quants'
super-blocks), for q|k|v and gate|up stored apart or fused, rope rows the converter permuted, experts split or
whole; a part that would cut a quantized block is refused, naming the fix."""

import numpy as np
import pytest

from cluster_configs.errors import CheckpointError
from models.gguf.reader import load_gguf
from models.gguf.writer import convert_to_gguf
from models.linear import dequantize
from models.tensor_parallel.shard import TensorShard
from tests.support.model_factory import build_model

# (checkpoint, file dtype, overrides, expert parallel): llama (permuted q/k rows, GQA) in float32 and in Q8_0
# with parts that are whole blocks of 32; Phi-3 (fused q|k|v and gate|up); Qwen3-MoE's experts split (float32)
# or whole (Q8_0); llama in Q4_K_M with parts that are whole super-blocks of 256 (o: 2 heads of 128 a rank)
CASES = {
    "llama-float32": ("llama", "float32", {}, False),
    "llama-q8_0": ("llama", "q8_0", {"head_dim": 16, "intermediate_size": 128}, False),
    "phi3-float32": ("phi3", "float32", {}, False),
    "qwen3_moe-float32": ("qwen3_moe", "float32", {}, False),
    "qwen3_moe_ep-q8_0": ("qwen3_moe", "q8_0", {"intermediate_size": 128}, True),
    "llama-q4_k_m": ("llama", "q4_k_m", {"hidden_size": 256, "head_dim": 128, "intermediate_size": 512},
                     False),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("gguf_tp")
    out = {}
    for case, (variant, dtype, overrides, _) in CASES.items():
        build_model(root / case, variant, **overrides)
        out[case] = convert_to_gguf(root / case, root / f"{case}.gguf", dtype)
    return out


def _same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("case", CASES)
def test_each_ranks_part_of_a_gguf_file_is_its_slices_of_the_whole_bit_for_bit(case, files):
    _, dtype, _, expert_parallel = CASES[case]
    spec, whole, _ = load_gguf(files[case], "auto")
    kept = set()
    for rank in range(2):
        shard = TensorShard(rank, 2, expert_parallel)
        rank_spec, part, _ = load_gguf(files[case], "auto", shard)
        assert rank_spec == spec  # the spec stays the whole model's
        lo, hi = shard.span(spec.vocab_size)
        _same(dequantize(part.embed), dequantize(whole.embed)[lo:hi])
        _same(dequantize(part.lm_head), dequantize(whole.lm_head)[lo:hi])
        _same(part.norm, whole.norm)
        for i, (w, p) in enumerate(zip(whole.layers, part.layers)):
            for field, name in (("qkv", "self_attn.qkv_proj"), ("o", "self_attn.o_proj"),
                                ("gate_up", "mlp.gate_up_proj"), ("down", "mlp.down_proj")):
                if getattr(w, field) is None:
                    continue
                kept.add(getattr(p, field).dtype)  # the file's format, not a requantized one
                _same(dequantize(getattr(p, field)),
                      shard.take(f"model.layers.{i}.{name}.weight", spec, dequantize(getattr(w, field))))
            _same(p.attn_norm, w.attn_norm)
            if w.experts is None:
                continue
            E, I, h = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
            gate_up = dequantize(w.experts.gate_up).reshape(E, 2, I, h)  # expert, gate | up, row, column
            down = dequantize(w.experts.down).reshape(E, h, I)
            if expert_parallel:
                first, end = shard.span(E)
                assert p.experts.held == (first, end)
                gate_up, down = gate_up[first:end], down[first:end]
            else:
                assert p.experts.held == (0, E)
                a, b = shard.span(I)
                gate_up, down = gate_up[:, :, a:b], down[:, :, a:b]
            _same(dequantize(p.experts.gate_up), gate_up.reshape(-1, h))
            _same(dequantize(p.experts.down), down.reshape(-1, down.shape[-1]))
            _same(p.experts.router, w.experts.router)
    assert dtype.removesuffix("_m") in kept


def test_a_part_that_would_cut_a_quantized_block_is_refused_naming_the_fix(model_dirs, tmp_path):
    """The tiny llama's o has 96 columns (4 heads of 24): 48 a rank, not whole Q8_0 blocks of 32."""
    path = convert_to_gguf(model_dirs["llama"], tmp_path / "llama-q8_0.gguf", "q8_0")
    with pytest.raises(CheckpointError, match=r"attn_output.* blocks of 32 .* value 48, inside a block; .*"
                                              "tensor_parallel_size"):
        load_gguf(path, "auto", TensorShard(1, 2))
    load_gguf(path, "q8_0", TensorShard(0, 1))  # one rank: the whole rows
