"""Export a loaded model as a GGUF file llama.cpp runs, under its family's llama.cpp architecture
(models/gguf/families.py), every tensor byte for byte in its served format."""

import math
import os
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGML_QUANT_VERSION, GGMLQuantizationType, GGUFWriter

from cluster_configs.errors import CheckpointError
from memory.matrices import Matrix, StackedMatrix, WeightMatrix, parts
from memory.weights import ModelWeights
from models.gguf.families import FAMILIES, GGUFFamily, layer_field, layer_layouts
from models.gguf.format import FILE_TYPE, GGML_TYPE, GT
from models.gguf.model_spec import rope_tensors, spec_metadata
from models.gguf.reader import take_rows
from models.gguf.vocab import GGUFVocab, synthetic_vocab, vocab_from_tokenizer
from models.loader import load_model
from models.model_spec import ModelSpec
from models.quantization.imatrix import read_imatrix
from models.tokenizer import Tokenizer

# (GGUF name, served tensor, rows of it to write or None for all, the file's shape: None for the rows' own)
Plan = list[tuple[str, WeightMatrix | np.ndarray, np.ndarray | None, tuple[int, ...] | None]]


def _tensor_plan(spec: ModelSpec, weights: ModelWeights, family: GGUFFamily) -> Plan:
    """Every tensor of the file, in order: fused matrices split lazily, merged expert tensors 3-D."""
    plan = [("token_embd.weight", weights.embed, None, None),
            ("output_norm.weight", weights.norm, None, None)]
    if not spec.tie_word_embeddings:
        plan.append(("output.weight", weights.lm_head, None, None))
    plan += [(name, factors, None, None) for name, factors in rope_tensors(spec).items()]
    for i, layer in enumerate(weights.layers):
        for field, options in layer_layouts(spec, family, i).items():
            plan += [(f"blk.{i}.{slot.name}", layer_field(layer, field), slot.rows,
                      slot.shape if len(slot.shape) > 2 else None) for slot in options[0]]
    return plan


def _tensor_info(t: Matrix | np.ndarray, rows,
                 shape: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], GGMLQuantizationType, int]:
    """-> (shape in elements, GGUF type, bytes) without building the data."""
    if not isinstance(t, np.ndarray):
        t, rows = _part(t, rows)
    kind = GT.F32 if isinstance(t, np.ndarray) else GGML_TYPE[t.dtype]
    shape = shape or (t.shape if rows is None else (len(rows), *t.shape[1:]))
    block, size = GGML_QUANT_SIZES[kind]
    return shape, kind, math.prod(shape) // block * size


def _part(t: Matrix, rows: np.ndarray | None) -> tuple[Matrix, np.ndarray | None]:
    """The matrix that holds these rows (a StackedMatrix's part: a file tensor is one part) and the rows in
    it."""
    if not isinstance(t, StackedMatrix):
        return t, rows
    for part, (a, b) in zip(t.parts, t.row_ranges()):
        if rows is not None and len(rows) and a <= rows.min() and rows.max() < b:
            return part, rows - a
    raise ValueError("a GGUF tensor must lie within one part of a StackedMatrix")


def _tensor_data(t: Matrix | np.ndarray, rows) -> np.ndarray:
    """GGML's layout: F32 as is; F16 and BF16 as their bits; Q8_0, Q4_0 as uint8 [N, bytes per row] of
    (fp16 d, qs) blocks; the K-quants and legacy types as their raw blocks."""
    if isinstance(t, np.ndarray):
        return np.ascontiguousarray(t if rows is None else t[rows], np.float32)
    t, rows = _part(t, rows)
    if not isinstance(t, WeightMatrix):  # packed for its activations
        t = t.unpack()
    w = t if rows is None else take_rows(t, rows)
    return np.ascontiguousarray(w.data) if w.dtype == "float32" else w.ggml_blocks()


def _file_dtype(weights: ModelWeights) -> str:
    """The llama.cpp file type's name: the layers' most common format by values; "q4_k_m" when Q4_K with
    Q6_K (llama.cpp's Q4_K_M mix)."""
    values: dict[str, int] = {}
    for layer in weights.layers:
        for key in layer.projections:
            for p in parts(layer.projection(key)):
                values[p.dtype] = values.get(p.dtype, 0) + p.shape[0] * p.shape[1]
    dtype = max(values, key=values.get)
    return "q4_k_m" if dtype == "q4_k" and "q6_k" in values else dtype


def _add_model_metadata(writer: GGUFWriter, spec: ModelSpec, weights: ModelWeights, name: str,
                        family: GGUFFamily, plan: Plan, vocab: GGUFVocab) -> None:
    writer.add_name(name)
    writer.add_file_type(FILE_TYPE[_file_dtype(weights)])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    shapes = {tensor_name: _tensor_info(t, rows, shape)[0] for tensor_name, t, rows, shape in plan}
    token_ids = {f"tokenizer.ggml.{kind}_token_id": token_id for kind, token_id in
                 (("bos", vocab.bos), ("eos", vocab.eos)) if token_id is not None}
    for key, (value, *types) in spec_metadata(spec, family, shapes, token_ids).items():
        writer.add_key_value(key, value, *types)


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
    """Write a loaded model as a GGUF file llama.cpp runs, under its family's architecture: every tensor in
    its served format (q8_0 -> Q8_0, q4_0 -> Q4_0, float16 -> F16, bfloat16 -> BF16, float32 -> F32, norms
    and biases F32), byte for byte. A model without a tokenizer gets a synthetic byte-level vocabulary of
    vocab_size tokens."""
    family = FAMILIES.get(spec.arch.gguf)
    if family is None:
        raise CheckpointError(f"{spec.architecture} has no GGUF architecture numaserve writes (it writes "
                              f"{', '.join(FAMILIES)}); convert it with llama.cpp's convert_hf_to_gguf.py")
    out_path = Path(out_path)
    vocab = synthetic_vocab(spec) if tokenizer is None else vocab_from_tokenizer(spec, tokenizer)
    tmp = out_path.with_name(out_path.name + ".tmp")
    writer = GGUFWriter(tmp, family.name)
    plan = _tensor_plan(spec, weights, family)
    _add_model_metadata(writer, spec, weights, name, family, plan, vocab)
    _add_vocab(writer, vocab)
    for tensor_name, t, rows, file_shape in plan:
        shape, kind, nbytes = _tensor_info(t, rows, file_shape)
        # shape in elements
        writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t, rows, _ in plan:  # one tensor in memory at a time
        writer.write_tensor_data(_tensor_data(t, rows))
    writer.close()
    os.replace(tmp, out_path)
    return out_path


def convert_to_gguf(model_path: str | Path, out_path: str | Path, weight_dtype: str = "q8_0",
                    imatrix: str | Path | None = None) -> Path:
    """Load a Hugging Face directory (or a GGUF) at `weight_dtype` and write it as GGUF; imatrix: an
    importance matrix file to quantize with (llama-quantize --imatrix's rules and bytes)."""
    spec, weights, tokenizer = load_model(model_path, weight_dtype,
                                          imatrix=None if imatrix is None else read_imatrix(imatrix))
    return export_gguf(spec, weights, tokenizer, out_path, name=Path(model_path).name)
