"""Importance matrices as llama.cpp writes and reads them (`llama-imatrix`, `llama-quantize --imatrix`).

An importance matrix holds, per weight tensor of a GGUF model (llama.cpp's names: blk.{i}.attn_q.weight, ...,
output.weight), the sum over calibration tokens of each input column's squared activation, per expert for
merged expert tensors, and how many tokens went into each sum. A quantizer weighs a matrix's columns by the
mean, sums / counts (memory/matrices.py's WeightMatrix.from_float(importance=)).

Files:
- GGUF (current llama.cpp): general.type "imatrix", imatrix.datasets [str], imatrix.chunk_count,
  imatrix.chunk_size (u32), and per tensor "<name>.in_sum2" f32 [nmat, K] and "<name>.counts" f32 [nmat];
- legacy .dat (read and written): int32 n_entries, per entry int32 length, name, int32 ncall, int32 nval,
  f32 values[nval] = sums / count * ncall; then int32 chunk count, int32 length, dataset name. Its means are
  values / ncall, as llama-quantize computes them.

Collection (`numaserve calibrate MODEL --imatrix OUT`, models/quantization/calibrate.py) follows
llama-imatrix: the text tokenized whole, cut into chunks of chunk_size tokens (the last partial one
dropped), each chunk's first token replaced by BOS where the tokenizer adds one, each chunk run from
position 0; a matrix's inputs count only from calls of 16 tokens or more (a routed expert's: every call);
the fused q|k|v and gate|up inputs are recorded under each of llama.cpp's separate tensors (the same values:
the same input).
"""

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

from cluster_configs.errors import CheckpointError
from models.gguf.families import FAMILIES, TensorSlot, layer_layouts
from models.model_spec import ModelSpec

MATRIX_FIELDS = ("qkv", "o", "gate_up", "down", "experts.gate_up", "experts.down")  # layer_layouts' matrices
MIN_TOKENS = 16  # llama-imatrix skips matrix products over fewer tokens
GGUF_SUFFIXES = (".in_sum2", ".counts")


@dataclass(frozen=True, eq=False)
class ImatrixEntry:
    sums: np.ndarray  # f32 [nmat, K]: per matrix (expert) of the tensor, sum over tokens of x**2 per column
    counts: np.ndarray  # f32 [nmat]: tokens summed into each (a legacy file: its ncall, sums pre-scaled)

    def __eq__(self, other) -> bool:
        return (isinstance(other, ImatrixEntry) and np.array_equal(self.sums, other.sums)
                and np.array_equal(self.counts, other.counts))

    __hash__ = None


@dataclass(frozen=True)
class ImportanceMatrix:
    entries: dict[str, ImatrixEntry]  # GGUF tensor name -> its sums
    datasets: tuple[str, ...] = ()
    chunk_count: int = 0
    chunk_size: int = 0
    path: str | None = field(default=None, compare=False)  # the file it was read from

    def importance(self, name: str) -> np.ndarray | None:
        """The tensor's column weights as llama-quantize computes them, f32 [nmat, K] (a legacy file's expert
        tensor: [1, nmat * K]): sums / counts, 1 where a matrix (an expert never routed to) has no tokens;
        None when the file has no entry for it."""
        entry = self.entries.get(name)
        if entry is None:
            return None
        out = np.ones_like(entry.sums)
        seen = entry.counts > 0
        out[seen] = entry.sums[seen] / entry.counts[seen, None]
        return out


class ImatrixError(CheckpointError):
    """An importance matrix file that cannot be read, or that does not fit the model it is used with."""


# ---- files -----------------------------------------------------------------------------------------------

def read_imatrix(path: str | Path) -> ImportanceMatrix:
    """A GGUF imatrix file or a legacy .dat one (told apart by the GGUF magic)."""
    path = Path(path)
    try:
        head = path.read_bytes()[:4]
    except OSError as e:
        raise ImatrixError(f"{path}: cannot be read ({e.strerror}); pass the file `numaserve calibrate MODEL "
                           "--imatrix OUT` or llama-imatrix wrote") from None
    try:
        im = _read_gguf(path) if head == b"GGUF" else _read_legacy(path)
    except (ValueError, IndexError, KeyError, struct.error, UnicodeDecodeError) as e:
        raise ImatrixError(f"{path}: not a readable importance matrix ({e}); write one with `numaserve "
                           "calibrate MODEL --imatrix OUT` or llama-imatrix") from None
    if not im.entries:
        raise ImatrixError(f"{path}: holds no importance matrix entries; write one with `numaserve calibrate "
                           "MODEL --imatrix OUT` or llama-imatrix")
    return im


def _read_gguf(path: Path) -> ImportanceMatrix:
    reader = gguf.GGUFReader(path)
    fields = {name: f.contents() for name, f in reader.fields.items()}
    tensors = {t.name: np.array(t.data, np.float32) for t in reader.tensors}
    entries = {}
    for name in sorted({n.removesuffix(s) for n in tensors for s in GGUF_SUFFIXES if n.endswith(s)}):
        sums, counts = tensors.get(name + ".in_sum2"), tensors.get(name + ".counts")
        if sums is None or counts is None:
            raise ValueError(f"tensor {name!r} has sums without counts or counts without sums")
        counts = counts.reshape(-1)
        entries[name] = ImatrixEntry(sums.reshape(len(counts), -1), counts)
    return ImportanceMatrix(entries, tuple(fields.get(gguf.Keys.IMatrix.DATASETS) or ()),
                            int(fields.get(gguf.Keys.IMatrix.CHUNK_COUNT, 0)),
                            int(fields.get(gguf.Keys.IMatrix.CHUNK_SIZE, 0)), str(path))


def _read_legacy(path: Path) -> ImportanceMatrix:
    data = path.read_bytes()
    at = 0

    def take(fmt: str):
        nonlocal at
        values = struct.unpack_from(fmt, data, at)
        at += struct.calcsize(fmt)
        return values

    (n_entries,) = take("<i")
    if n_entries < 1:
        raise ValueError(f"{n_entries} entries")
    entries = {}
    for _ in range(n_entries):
        (length,) = take("<i")
        name = data[at:at + length].decode()
        at += length
        ncall, nval = take("<ii")
        if nval < 1 or at + 4 * nval > len(data):
            raise ValueError(f"entry {name!r}: {nval} values")
        values = np.frombuffer(data, np.float32, nval, at).copy()
        at += 4 * nval
        entries[name] = ImatrixEntry(values[None], np.array([ncall], np.float32))
    chunk_count, datasets = 0, ()
    if at < len(data):  # the trailing chunk count and dataset name are optional
        (chunk_count,) = take("<i")
        if at + 4 <= len(data):
            (length,) = take("<i")
            datasets = (data[at:at + length].decode(),) if length > 0 else ()
    return ImportanceMatrix(entries, datasets, chunk_count, 0, str(path))


def write_imatrix(im: ImportanceMatrix, path: str | Path) -> Path:
    """As llama-imatrix writes it: GGUF, or the legacy format for a path ending in .dat (entries whose
    tokens are all zero are left out of a .dat, as llama.cpp does)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    if path.suffix == ".dat":
        _write_legacy(im, tmp)
    else:
        writer = gguf.GGUFWriter(tmp, arch="imatrix")  # general.architecture: gguf-py writes one
        writer.add_type(gguf.GGUFType.IMATRIX)
        # llama-quantize refuses a GGUF imatrix without the key; gguf-py cannot write an empty array
        writer.add_array(gguf.Keys.IMatrix.DATASETS, list(im.datasets) or [""])
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_COUNT, im.chunk_count)
        writer.add_uint32(gguf.Keys.IMatrix.CHUNK_SIZE, im.chunk_size)
        for name in sorted(im.entries):
            entry = im.entries[name]
            writer.add_tensor(name + ".in_sum2", np.ascontiguousarray(entry.sums, np.float32))
            writer.add_tensor(name + ".counts", np.ascontiguousarray(entry.counts, np.float32).reshape(-1, 1))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    tmp.replace(path)
    return path


def _write_legacy(im: ImportanceMatrix, path: Path) -> None:
    chunk = max(1, im.chunk_size)
    out = bytearray()
    kept = [name for name in sorted(im.entries) if (im.entries[name].counts > 0).any()]
    out += struct.pack("<i", len(kept))
    for name in kept:
        entry = im.entries[name]
        ncall = int((entry.counts.max() + chunk - 1) // chunk)
        counts = np.where(entry.counts > 0, entry.counts, 1).astype(np.float32)
        sums = np.where(entry.counts[:, None] > 0, entry.sums, 1).astype(np.float32)
        values = (sums / counts[:, None] * np.float32(ncall)).astype(np.float32).reshape(-1)
        encoded = name.encode()
        out += struct.pack("<i", len(encoded)) + encoded + struct.pack("<ii", ncall, values.size)
        out += values.tobytes()
    dataset = (im.datasets[-1] if im.datasets else "").encode()
    out += struct.pack("<i", im.chunk_count) + struct.pack("<i", len(dataset)) + dataset
    path.write_bytes(bytes(out))


# ---- collection ------------------------------------------------------------------------------------------

def tensor_names(spec: ModelSpec, process_output: bool = False) -> dict[str, tuple[str, ...]]:
    """The forward's matrix names (DecoderModel's observer: layers.{i}.qkv | o | gate_up | down,
    layers.{i}.experts.{e}.gate_up | down, lm_head) -> the GGUF tensors their input feeds. Expert names map
    with the expert left out: the collector files an expert's sums under its row of the merged tensor."""
    names = {f"layers.{i}.{fld}": tuple(f"blk.{i}.{slot.name}" for slot in slots)
             for i, fld, slots in _layer_matrices(spec)}
    if process_output and not spec.tie_word_embeddings:
        names["lm_head"] = ("output.weight",)
    return names


class ImatrixCollector:
    """A DecoderModel observer summing each matrix's squared inputs, per expert for experts."""

    def __init__(self, spec: ModelSpec, process_output: bool = False):
        self.names = tensor_names(spec, process_output)
        self.num_experts = spec.num_experts
        self.sums: dict[str, np.ndarray] = {}  # observer name -> [nmat, K] f32
        self.counts: dict[str, np.ndarray] = {}  # observer name -> [nmat] int64

    def observe(self, name: str, x: np.ndarray) -> None:
        expert = 0
        if ".experts." in name:  # layers.{i}.experts.{e}.{key}: every routed call counts
            head, e, key = name.rsplit(".", 2)
            name, expert = f"{head}.{key}", int(e)
        elif x.shape[0] < MIN_TOKENS:
            return
        if name not in self.names:
            return
        if name not in self.sums:
            nmat = self.num_experts if ".experts." in name else 1
            self.sums[name] = np.zeros((nmat, x.shape[1]), np.float32)
            self.counts[name] = np.zeros(nmat, np.int64)
        acc = self.sums[name][expert]
        for row in np.asarray(x, np.float32):  # float32, token by token: llama-imatrix's sums and roundings
            acc += row * row
        self.counts[name][expert] += x.shape[0]

    def result(self, datasets: tuple[str, ...], chunk_count: int, chunk_size: int) -> ImportanceMatrix:
        entries = {}
        for name, sums in self.sums.items():
            entry = ImatrixEntry(sums.astype(np.float32), self.counts[name].astype(np.float32))
            entries |= {tensor: entry for tensor in self.names[name]}
        return ImportanceMatrix(entries, datasets, chunk_count, chunk_size)


def imatrix_chunks(tokens: np.ndarray, chunk_size: int, bos: int | None) -> list[np.ndarray]:
    """llama-imatrix's chunks: consecutive, chunk_size tokens each (a partial last one dropped), the first
    token of each replaced by bos (None: kept)."""
    chunks = [tokens[s:s + chunk_size].copy() for s in range(0, len(tokens) - chunk_size + 1, chunk_size)]
    if bos is not None:
        for chunk in chunks:
            chunk[0] = bos
    return chunks


# ---- use -------------------------------------------------------------------------------------------------

def model_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The whole model's quantized tensors under llama.cpp's names (numpy order: [N, K], experts [E, N, K]):
    every layer matrix, the output (untied) and the token embedding."""
    shapes = {"token_embd.weight": (spec.vocab_size, spec.hidden_size)}
    if not spec.tie_word_embeddings:
        shapes["output.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes | {f"blk.{i}.{slot.name}": slot.shape
                      for i, _, slots in _layer_matrices(spec) for slot in slots}


def _layer_matrices(spec: ModelSpec) -> Iterator[tuple[int, str, tuple[TensorSlot, ...]]]:
    """(layer, LayerWeights field, the GGUF tensors it is written as) for every matrix of every layer."""
    family = FAMILIES.get(spec.arch.gguf)
    if family is None:
        raise ImatrixError(f"{spec.architecture} has no GGUF architecture numaserve writes, so its tensors "
                           "have no llama.cpp names to file importance under")
    for i in range(spec.num_layers):
        for fld, options in layer_layouts(spec, family, i).items():
            if fld in MATRIX_FIELDS:
                yield i, fld, options[0]


class ImportanceLookup:
    """The importance each tensor of a model (or of a tensor-parallel rank's shard) is quantized with, by
    llama.cpp's tensor name: f32 [nmat, K] of the shard's columns (and held experts), or None (without).

    Checked at construction against the whole model: every layer matrix (blk.*) must have an entry of its
    size; output.weight and token_embd.weight use one where the file has it (llama-imatrix records the output
    only with --process-output, the embedding never)."""

    def __init__(self, im: ImportanceMatrix, spec: ModelSpec, shard=None):
        self.im, self.spec, self.shard = im, spec, shard
        where = im.path or "the importance matrix"
        self.shapes = model_tensor_shapes(spec)
        for name, shape in self.shapes.items():
            entry = im.entries.get(name)
            if entry is None:
                if name.startswith("blk."):
                    raise ImatrixError(
                        f"{where}: has no entry for tensor {name!r}; it was computed for another model (or "
                        "another architecture's tensor names): compute one for this model with `numaserve "
                        "calibrate MODEL --imatrix OUT`")
                continue
            nmat = shape[0] if len(shape) == 3 else 1  # a legacy file has an expert tensor's sums in one row
            if entry.sums.size != nmat * shape[-1]:
                raise ImatrixError(
                    f"{where}: tensor {name!r} has importance for {entry.sums.size} columns, the model's "
                    f"tensor takes {nmat} x {shape[-1]}; it was computed for another model: compute one for "
                    "this model with `numaserve calibrate MODEL --imatrix OUT`")

    def __call__(self, name: str) -> np.ndarray | None:
        importance = self.im.importance(name)
        if importance is None:
            return None
        shape = self.shapes[name]
        importance = importance.reshape(-1, shape[-1])  # [nmat, K]
        plan = None if self.shard is None else self.shard.gguf_pieces(name, self.spec)
        if plan is None:
            return importance
        axis, spans = plan
        if axis == len(shape) - 1:  # the shard holds some of the columns
            return np.concatenate([importance[:, lo:hi] for lo, hi in spans], axis=1)
        if axis == 0 and len(shape) == 3:  # some of the experts
            return np.concatenate([importance[lo:hi] for lo, hi in spans])
        return importance  # some of the rows: every row sees every column
