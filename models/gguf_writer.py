"""Export a loaded model as a llama GGUF file llama.cpp runs, every tensor byte for byte in its served
format."""

import json
import math
import os
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter, RopeScalingType

from cluster_configs.errors import CheckpointError
from memory.weights import Bf16Matrix, Int8Matrix, ModelWeights, WeightMatrix
from models.gguf_format import (
    ARCH,
    FILE_TYPE,
    GGML_TYPE,
    GT,
    ROPE_SCALING_KEY,
    rope_freq_factors,
    rope_row_order,
    rope_type,
)
from models.gguf_reader import take_rows
from models.gguf_vocab import GGUFVocab, synthetic_vocab, vocab_from_tokenizer
from models.loader import load_model
from models.spec import ModelSpec
from models.tokenizer import Tokenizer


def _tensor_plan(spec: ModelSpec,
                 weights: ModelWeights) -> list[tuple[str, WeightMatrix | np.ndarray, np.ndarray | None]]:
    """(GGUF name, served tensor, rows of it to write or None for all): fused matrices split lazily."""
    q, kv, inter, D = spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    plan = [("token_embd.weight", weights.embed, None), ("output_norm.weight", weights.norm, None)]
    if not spec.tie_word_embeddings:
        plan.append(("output.weight", weights.lm_head, None))
    if rope_type(spec) == "llama3":
        plan.append(("rope_freqs.weight", rope_freq_factors(spec), None))
    q_rows, k_rows = rope_row_order(spec.num_heads, D), q + rope_row_order(spec.num_kv_heads, D)
    for i, layer in enumerate(weights.layers):
        p = f"blk.{i}."
        plan += [(p + "attn_norm.weight", layer.attn_norm, None),
                 (p + "attn_q.weight", layer.qkv, q_rows),
                 (p + "attn_k.weight", layer.qkv, k_rows),
                 (p + "attn_v.weight", layer.qkv, np.arange(q + kv, q + 2 * kv)),
                 (p + "attn_output.weight", layer.o, None),
                 (p + "ffn_norm.weight", layer.mlp_norm, None),
                 (p + "ffn_gate.weight", layer.gate_up, np.arange(inter)),
                 (p + "ffn_up.weight", layer.gate_up, np.arange(inter, 2 * inter)),
                 (p + "ffn_down.weight", layer.down, None)]
    return plan


def _tensor_info(t: WeightMatrix | np.ndarray, rows) -> tuple[tuple[int, ...], GGMLQuantizationType, int]:
    """-> (shape in elements, GGUF type, bytes) without building the data."""
    kind = GT.F32 if isinstance(t, np.ndarray) else GGML_TYPE[t.dtype]
    shape = t.shape if rows is None else (len(rows), t.shape[1])
    block, size = GGML_QUANT_SIZES[kind]
    return shape, kind, math.prod(shape) // block * size


def _tensor_data(t: WeightMatrix | np.ndarray, rows) -> np.ndarray:
    """GGML's layout: F32 as is; BF16, Q8_0, Q4_0 as uint8 [N, bytes per row] of (fp16 d, qs) blocks."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t, np.float32)
    if isinstance(t, (Int8Matrix, Bf16Matrix)):
        t = t.unpack()
    w = t if rows is None else take_rows(t, rows)
    if w.dtype == "float32":
        return np.ascontiguousarray(w.data)
    if w.dtype == "bfloat16":
        return np.ascontiguousarray(w.data).view(np.uint8)
    n, num_blocks = w.scales.shape
    scales = np.ascontiguousarray(w.scales).view(np.uint8).reshape(n, num_blocks, 2)
    qs = np.ascontiguousarray(w.data).view(np.uint8).reshape(n, num_blocks, -1)  # [N, K // 32, 32 | 16]
    return np.concatenate([scales, qs], axis=2).reshape(n, -1)


def _add_model_metadata(writer: GGUFWriter, spec: ModelSpec, weights: ModelWeights, name: str) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPE[weights.layers[0].qkv.dtype])
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
    if rope_type(spec) == "linear":
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


def export_gguf(spec: ModelSpec, weights: ModelWeights, tokenizer: Tokenizer | None, out_path: str | Path,
                name: str = "numaserve export") -> Path:
    """Write a loaded model as a llama GGUF file llama.cpp runs: every tensor in its served format (q8_0 ->
    Q8_0, q4_0 -> Q4_0, bfloat16 -> BF16, float32 -> F32, norms F32), byte for byte. A model without a
    tokenizer gets a synthetic byte-level vocabulary of vocab_size tokens."""
    if spec.arch.gguf != "llama" or spec.qkv_bias or any(spec.layer_windows):
        raise CheckpointError(f"{spec.architecture} with attention biases or sliding windows has no llama "
                              "GGUF equivalent; convert it with llama.cpp's convert_hf_to_gguf.py")
    out_path = Path(out_path)
    vocab = synthetic_vocab(spec) if tokenizer is None else vocab_from_tokenizer(spec, tokenizer)
    tmp = out_path.with_name(out_path.name + ".tmp")
    writer = GGUFWriter(tmp, ARCH)
    _add_model_metadata(writer, spec, weights, name)
    _add_vocab(writer, vocab)
    plan = _tensor_plan(spec, weights)
    for tensor_name, t, rows in plan:
        shape, kind, nbytes = _tensor_info(t, rows)
        # shape in elements
        writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
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
