"""Read a GGUF file of a supported family (models/gguf/families.py) into numaserve's (spec, weights,
tokenizer): tensors copied out of the file and stacked into our fused projections, q/k rows un-permuted to
Hugging Face's rope order where the family's converter permuted them, each matrix served in its stored format
where it can be."""

import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from tqdm import tqdm

from cluster_configs.errors import CheckpointError
from memory.experts import ExpertWeights
from memory.matrices import Matrix, StackedMatrix, WeightMatrix, stacked
from memory.weights import LayerHook, LayerWeights, ModelWeights, as_built
from models.gguf.families import FAMILIES, GGUFFamily, Layout, layer_layouts
from models.gguf.format import AUTO, GT, RAW_BLOCKS, ROPE_TENSORS
from models.gguf.header import TensorInfo, read_header
from models.gguf.model_spec import spec_from_gguf
from models.gguf.vocab import tokenizer_from_metadata
from models.linear import dequantize
from models.model_spec import ModelSpec
from models.quantization.imatrix import ImportanceLookup, ImportanceMatrix
from models.quantization.quant_mix import embedding_dtype, lm_head_dtype, matrix_dtype
from models.tensor_parallel.shard import WHOLE_MODEL, TensorShard
from models.tokenizer import Tokenizer

# ---- reading ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredTensor:
    """A tensor copied out of the file, in the file's format: a WeightMatrix of the dtype AUTO names, its
    bytes unchanged; 1-D tensors as one row."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order: [N, K] or [N]
    value: WeightMatrix | None  # None: not copied (read_gguf's copied)


def read_gguf(path: Path, copied: set[str] | None = None,
              strings: bool = True) -> tuple[dict, dict[str, StoredTensor]]:
    """-> (metadata, tensors), all copied into process memory, no mapping of the file kept (the VM reclaims
    idle file pages, so a long-lived mmap would re-read the disk in the middle of serving).
    copied: the names of the tensors whose values are wanted (None: all); the others hold value None.
    strings=False: metadata arrays of strings (the vocabulary) come as their lengths alone
    (header.UnreadStrings)."""
    tensors, metadata = _open(path, strings)
    return metadata, {t.name: _copy_tensor(path, t) if copied is None or t.name in copied else _shape_only(t)
                      for t in tensors}


def _open(path: Path, strings: bool = True) -> tuple[list[TensorInfo], dict]:
    """-> (the file's tensors, its metadata)."""
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file; pass the path of a .gguf file")
    try:
        metadata, tensors = read_header(path, strings)
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: a metadata value is unreadable ({e}); the file is corrupt: "
                              "re-download or re-export it") from None
    except (ValueError, IndexError, OverflowError, EOFError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e}); if it was copied or downloaded, "
                              "check that it is complete; write one with numaserve's export_gguf or "
                              "convert_hf_to_gguf.py") from None
    return tensors, metadata


def _shape_only(t: TensorInfo) -> StoredTensor:
    return StoredTensor(t.tensor_type, tuple(reversed(t.dims)), None)


@dataclass(frozen=True)
class Pending:
    """A tensor not copied yet: copied when a layer takes it (_pop), so that a load holds the file's copy of
    one layer at a time beside the weights built, not of the whole model."""

    info: TensorInfo
    pieces: tuple[int, list[tuple[int, int]]] | None  # _copy_tensor's


def _check_loadable(path: Path, t: TensorInfo) -> None:
    kind = t.tensor_type
    if kind not in AUTO:
        loaded = ", ".join(k.name for k in AUTO)
        what = "an I-quant (IQ*)" if kind.name.startswith("IQ") else "a type"
        raise CheckpointError(
            f"{path}: tensor {t.name!r} is {kind.name}, {what} numaserve does not load (it loads {loaded}); "
            "requantize the F16 / BF16 GGUF with `llama-quantize model-f16.gguf out.gguf Q4_K_M` (or Q8_0, "
            "Q6_K, Q5_K_M, Q4_0), or load the Hugging Face directory with weight_dtype='q4_k_m'")


def _copy_tensor(path: Path, t: TensorInfo,
                 pieces: tuple[int, list[tuple[int, int]]] | None = None) -> StoredTensor:
    """pieces: (axis, spans) of the tensor (numpy order) to copy, concatenated (a tensor-parallel rank's part,
    models/tensor_parallel/shard.py); None: all of it."""
    _check_loadable(path, t)
    kind = t.tensor_type
    shape = tuple(reversed(t.dims))
    data = _read_tensor(path, t)  # the shape, but a quantized type's rows in bytes: [..., N, bytes per row]
    if pieces is not None:
        data, shape = _part(path, t.name, kind, data, shape, *pieces)
    # F32, F16: [N, K] of their numpy dtypes; the others: uint8 [N, bytes per row]
    data = np.ascontiguousarray(data.reshape(-1, data.shape[-1]))
    if kind in RAW_BLOCKS:
        return StoredTensor(kind, shape, WeightMatrix(RAW_BLOCKS[kind], data.view(np.uint8)))
    if kind in (GT.F16, GT.F32):
        return StoredTensor(kind, shape, WeightMatrix(AUTO[kind], data))
    if kind == GT.BF16:
        return StoredTensor(kind, shape, WeightMatrix("bfloat16", data.view(np.uint16)))
    return StoredTensor(kind, shape, WeightMatrix.from_ggml_blocks(AUTO[kind], data.view(np.uint8)))


def _read_tensor(path: Path, t: TensorInfo) -> np.ndarray:
    """t's bytes read from the file into a new array of t's data dtype and shape. Not copied out of a mapping
    of the file: every page copied from there would also stay in this process's resident memory until the
    mapping is gone, so a load would peak at twice the file."""
    data = np.empty(t.data_shape, t.data_dtype)
    view, done = memoryview(data.reshape(-1)).cast("B"), 0
    with open(path, "rb", buffering=0) as f:
        f.seek(t.data_offset)
        while done < data.nbytes:  # a read returns at most ~2 GiB
            got = f.readinto(view[done:])
            if not got:
                raise CheckpointError(f"{path}: tensor {t.name!r} runs past the end of the file; the file "
                                      "is truncated: re-download or re-export it")
            done += got
    return data


def _part(path: Path, name: str, kind: GGMLQuantizationType, data: np.ndarray, shape: tuple[int, ...],
          axis: int, spans: list[tuple[int, int]]) -> tuple[np.ndarray, tuple[int, ...]]:
    """The spans of data along axis, concatenated, and their shape. Along a row a quantized type is cut at
    whole blocks only (their bytes kept): a span that splits one is a CheckpointError."""
    block, block_bytes = GGML_QUANT_SIZES[kind]
    if max(hi for _, hi in spans) > shape[axis]:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, too small for the model its "
                              "metadata describe; the weights and the metadata do not match")
    units = spans
    if axis == len(shape) - 1:  # along a row: in the array's units (bytes of blocks, or values)
        cut = next((x for span in spans for x in span if x % block), None)
        if cut is not None:
            raise CheckpointError(
                f"{path}: tensor {name!r} is {kind.name}, stored in blocks of {block} values, and a "
                f"tensor-parallel rank's part of its rows starts or ends at value {cut}, inside a block; "
                "serve this file with a tensor_parallel_size whose parts are whole blocks (1 always is; for "
                "a MoE model, enable_expert_parallel keeps experts whole), or load a float GGUF or the "
                "Hugging Face checkpoint and quantize on load (weight_dtype)")
        units = [(lo // block * block_bytes // data.itemsize, hi // block * block_bytes // data.itemsize)
                 for lo, hi in spans]
    index = (slice(None),) * axis
    parts = [data[index + (slice(lo, hi),)] for lo, hi in units]
    local = list(shape)
    local[axis] = sum(hi - lo for lo, hi in spans)
    return (parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)), tuple(local)


# ---- weights ---------------------------------------------------------------------------------------------

def _spec(path: Path, metadata: dict, tensors: dict[str, StoredTensor]) -> ModelSpec:
    """The spec from the metadata and the tensors' shapes; the rope tensors are consumed."""
    rope = {name: tensors.pop(name) for name in ROPE_TENSORS if name in tensors}
    shapes = {name: t.shape for name, t in tensors.items()}
    return spec_from_gguf(path, metadata, shapes, lambda name: _vector(rope[name]) if name in rope else None)


def _pop(path: Path, tensors: dict[str, Pending], name: str, shape: tuple[int, ...]) -> StoredTensor:
    """The tensor `name`, copied from the file now and taken from `tensors`."""
    pending = tensors.pop(name, None)
    if pending is None:
        raise CheckpointError(f"{path}: tensor {name!r} is missing (expected shape {shape}); the file is "
                              "incomplete or its metadata do not describe its tensors")
    t = _copy_tensor(path, pending.info, pending.pieces)
    if t.shape != shape:
        raise CheckpointError(f"{path}: tensor {name!r} has shape {t.shape}, expected {shape} from the "
                              "metadata; the weights and the metadata do not match")
    return t


def _to_float(t: StoredTensor) -> np.ndarray:
    return dequantize(t.value)


def _vector(t: StoredTensor) -> np.ndarray:
    return np.ascontiguousarray(_to_float(t).reshape(-1))  # [N] f32


def _served(parts: list[StoredTensor], weight_dtype: str, wanted: list[str], rows: np.ndarray | None = None,
            importance: list[np.ndarray | None] | None = None) -> Matrix:
    """Parts stacked by rows (parts in different formats make a StackedMatrix). weight_dtype "auto" keeps
    each part's stored format; otherwise a part keeps the file's bytes where they are in weight_dtype or in
    its wanted format, and is requantized to the wanted one where not (with its importance, if any)."""
    mats = []
    for p, want, weights in zip(parts, wanted, importance or [None] * len(parts)):
        stored = AUTO[p.ggml_type]
        keep = weight_dtype == "auto" or stored in (weight_dtype, want)
        mats.append(p.value if keep else WeightMatrix.from_float(_to_float(p), want, weights))
    matrix = stacked(mats)
    return matrix if rows is None else take_rows(matrix, rows)


def take_rows(w: Matrix, rows: np.ndarray) -> Matrix:
    """w's rows in the order `rows` (a StackedMatrix's may only be reordered within each part)."""
    if isinstance(w, StackedMatrix):
        for a, b in w.row_ranges():
            if not np.array_equal(np.sort(rows[a:b]), np.arange(a, b)):
                raise ValueError("rows of a StackedMatrix can only be reordered within its parts")
        return StackedMatrix(tuple(take_rows(p, rows[a:b] - a) for p, (a, b) in zip(w.parts, w.row_ranges())))
    return WeightMatrix(w.dtype, w.data[rows], None if w.scales is None else w.scales[rows])


def _field(path: Path, tensors: dict[str, Pending], prefix: str, layouts: tuple[Layout, ...],
           weight_dtype: str, spec: ModelSpec, index: int, importance: ImportanceLookup | None):
    """A LayerWeights field of layer `index` from the first layout whose tensors the file has: matrices in a
    served format (a mix's choice per tensor category: models/quantization/quant_mix.py), vectors float32,
    rows back in our order."""
    layout = next((lay for lay in layouts if all(prefix + s.name in tensors for s in lay)), layouts[0])
    parts = [_pop(path, tensors, prefix + s.name, s.shape) for s in layout]
    order = None
    if any(s.rows is not None for s in layout):
        order = np.argsort(np.concatenate([s.rows for s in layout]))
        order = None if np.array_equal(order, np.arange(len(order))) else order
    if len(layout[0].shape) == 1:
        vector = np.concatenate([_vector(p) for p in parts])
        return vector if order is None else vector[order]
    wanted = [matrix_dtype(weight_dtype, s.name.split(".")[0].removesuffix("_exps"), index, spec,
                           importance is not None) for s in layout]
    weights = None if importance is None else [importance(prefix + s.name) for s in layout]
    return _served(parts, weight_dtype, wanted, order, weights)


def _weights(path: Path, spec: ModelSpec, family: str, tensors: dict[str, Pending], weight_dtype: str,
             vocab_rows: int, importance: ImportanceLookup | None, each_layer: LayerHook) -> ModelWeights:
    """spec: the shard's (models/tensor_parallel/shard.py's local_spec), vocab_rows its rows of the
    vocabulary."""
    h = spec.hidden_size

    def pop(name, shape):
        return _pop(path, tensors, name, shape)

    def served(name: str, dtype: str) -> Matrix:
        return _served([pop(name, (vocab_rows, h))], weight_dtype, [dtype],
                       importance=None if importance is None else [importance(name)])

    embed = served("token_embd.weight", embedding_dtype(weight_dtype, spec.tie_word_embeddings))
    norm = _vector(pop("output_norm.weight", (h,)))
    lm_head = embed if spec.tie_word_embeddings else served("output.weight", lm_head_dtype(weight_dtype))
    layers = tuple(each_layer(i, _layer(path, spec, FAMILIES[family], tensors, i, weight_dtype, importance))
                   for i in tqdm(range(spec.num_layers), desc=f"loading {path.name}",
                                 disable=not sys.stderr.isatty(), leave=False))
    if tensors:
        raise CheckpointError(f"{path}: tensors {sorted(tensors)[:4]} are not part of a {family} model "
                              "as numaserve runs it; serve the Hugging Face directory instead")
    return ModelWeights(embed=embed, norm=norm, lm_head=lm_head, layers=layers)


def _layer(path: Path, spec: ModelSpec, family: GGUFFamily, tensors: dict[str, Pending], i: int,
           weight_dtype: str, importance: ImportanceLookup | None) -> LayerWeights:
    fields = {}
    for field, options in layer_layouts(spec, family, i).items():
        if field == "experts.router":  # float32 whatever the weights' dtype (memory/experts.py)
            slot = options[0][0]
            fields[field] = np.ascontiguousarray(_to_float(_pop(path, tensors, f"blk.{i}.{slot.name}",
                                                                slot.shape)))
        else:
            fields[field] = _field(path, tensors, f"blk.{i}.", options, weight_dtype, spec, i, importance)
    if spec.is_moe(i):
        fields["experts"] = ExpertWeights(
            fields.pop("experts.router"), fields.pop("experts.gate_up"), fields.pop("experts.down"),
            spec.num_experts, spec.num_experts_per_tok, spec.normalize_routing, spec.moe_intermediate_size,
            (spec.held_experts or (0,))[0])
        fields |= {"gate_up": None, "down": None}
    return LayerWeights(**({} if spec.qkv_bias else {"qkv_bias": None}) | fields)


def read_gguf_spec(path: str | Path) -> ModelSpec:
    """The spec alone, from the metadata and the tensors' shapes: no weight is copied, no token decoded
    (the vocabulary's size is its length)."""
    path = Path(path)
    metadata, tensors = read_gguf(path, set(ROPE_TENSORS), strings=False)
    return _spec(path, metadata, tensors)


def load_gguf(path: str | Path, weight_dtype: str, shard: TensorShard = WHOLE_MODEL,
              imatrix: ImportanceMatrix | None = None, each_layer: LayerHook | None = None,
              ) -> tuple[ModelSpec, ModelWeights, Tokenizer | None]:
    """-> (spec, weights, tokenizer) like the Hugging Face loader. weight_dtype "auto" keeps the file's
    types (F16 as float16, BF16 as bfloat16, bit for bit); quantized tensors already in the wanted format keep
    their bytes; others are requantized (with imatrix's importance, if given). shard: a tensor-parallel
    rank's part, its slices alone kept (each tensor read whole, one at a time; the spec stays the whole
    model's); each_layer: applied to each layer as it is built, its tensors' copies then dropped
    (memory/weights.LayerHook). Each tensor is copied from the file as its layer is built (Pending)."""
    path = Path(path)
    infos, metadata = _open(path)
    head = {t.name: _copy_tensor(path, t) if t.name in ROPE_TENSORS else _shape_only(t) for t in infos}
    spec = _spec(path, metadata, head)
    for t in infos:
        _check_loadable(path, t)  # before anything is built
    tensors = {t.name: Pending(t, shard.gguf_pieces(t.name, spec))
               for t in infos if t.name not in ROPE_TENSORS}
    try:
        tokenizer = tokenizer_from_metadata(path, metadata)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- the tokenizers library raises a bare Exception for a bad vocabulary
        raise CheckpointError(f"{path}: the tokenizer.ggml.* vocabulary is inconsistent ({e}); the file is "
                              "corrupt: re-download or re-export it") from None
    vocab = shard.span(spec.vocab_size) if shard.size > 1 else (0, spec.vocab_size)
    importance = None if imatrix is None else ImportanceLookup(imatrix, spec, shard)
    weights = _weights(path, shard.local_spec(spec), metadata["general.architecture"], tensors, weight_dtype,
                       vocab[1] - vocab[0], importance, each_layer or as_built)
    return spec, weights, tokenizer
