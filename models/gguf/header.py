"""A GGUF file's header, its metadata and tensor descriptions, read in one pass over its bytes.

Why not gguf-py's GGUFReader (which numaserve used before, and whose results this equals: tests/models/
test_gguf_header.py): it makes a numpy view of every part of every metadata field, ~644k views for a
32,000-token vocabulary, which took 3.7 s on a 2-core Zen 1 VM at every start, warm or cold; the weights come
from the packed cache on a warm start, so that parse was most of it. Here a field is decoded with struct, an
array of numbers with one np.frombuffer. The tensors' bytes are not touched: the loader reads them
(models/gguf/reader.py)."""

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGMLQuantizationType, GGUFValueType

VERSIONS = (2, 3)
_SCALARS = {GGUFValueType.UINT8: "B", GGUFValueType.INT8: "b", GGUFValueType.UINT16: "H",
            GGUFValueType.INT16: "h", GGUFValueType.UINT32: "I", GGUFValueType.INT32: "i",
            GGUFValueType.FLOAT32: "f", GGUFValueType.UINT64: "Q", GGUFValueType.INT64: "q",
            GGUFValueType.FLOAT64: "d", GGUFValueType.BOOL: "?"}
# a tensor's data in numpy, as GGUFReader gives it: these types by element, the others as bytes per row
_ELEMENTS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
             GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
             GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
             GGMLQuantizationType.I64: np.int64}
HEADER_READ = 1 << 20  # bytes read at a time while the header runs on


@dataclass(frozen=True)
class UnreadStrings:
    """A metadata array of strings stepped over, not decoded (read_header's strings=False): its length
    alone."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    dims: tuple[int, ...]  # ggml order: the row length first
    data_offset: int  # from the start of the file
    data_dtype: np.dtype
    data_shape: tuple[int, ...]  # numpy order; a quantized type's rows in bytes


class _Bytes:
    """The file's bytes from the start, read on demand as the header is parsed (into one growing bytearray:
    amortized linear in the header's size, where bytes concatenation copied it all at every read)."""

    def __init__(self, path: Path):
        self.file = open(path, "rb")  # noqa: SIM115  (closed by read_header)
        self.size = os.fstat(self.file.fileno()).st_size
        self.buf = bytearray()
        self.pos = 0

    def need(self, n: int) -> None:
        if self.pos + n > self.size:  # a corrupt length: refused before anything that size is allocated
            raise EOFError(f"the header runs past the end of the file (at byte {self.pos}, {n} more)")
        while len(self.buf) < self.pos + n:
            more = self.file.read(max(HEADER_READ, self.pos + n - len(self.buf)))
            if not more:
                raise EOFError(f"the header runs past the end of the file (at byte {self.pos})")
            self.buf.extend(more)

    def unpack(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        self.need(size)
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return values

    def skip_strings(self, count: int) -> None:
        buf, pos, unpack = self.buf, self.pos, struct.Struct("<Q").unpack_from  # need() only past the buffer
        for _ in range(count):
            if pos + 8 > len(buf):
                self.pos = pos
                self.need(8)
            (n,) = unpack(buf, pos)
            pos += 8
            if pos + n > len(buf):
                self.pos = pos
                self.need(n)
            pos += n
        self.pos = pos

    def string(self) -> str:
        (n,) = self.unpack("Q")
        self.need(n)
        raw = self.buf[self.pos:self.pos + n].decode("utf-8")
        self.pos += n
        return raw

    def array(self, fmt: str, count: int) -> list:
        size = struct.calcsize("<" + fmt) * count
        self.need(size)
        values = np.frombuffer(self.buf, np.dtype("<" + fmt), count, self.pos).tolist()
        self.pos += size
        return values


def read_header(path: Path, strings: bool = True) -> tuple[dict, list[TensorInfo]]:
    """-> (metadata: key -> value as GGUFReader's field.contents(), the tensors in file order). ValueError,
    EOFError or UnicodeDecodeError for a file that is not a readable little-endian GGUF. strings=False:
    arrays of strings (a vocabulary, its merges) come as UnreadStrings, stepped over (a tenth of the time)."""
    src = _Bytes(path)
    try:
        (magic,) = src.unpack("I")
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        (version,) = src.unpack("I")
        if version & 0xFFFF == 0:
            raise ValueError("a big-endian GGUF file; convert it for little-endian hosts")
        if version not in VERSIONS:
            raise ValueError(f"GGUF version {version}, which this reader cannot handle")
        num_tensors, num_kv = src.unpack("QQ")
        metadata = {}
        for _ in range(num_kv):
            key = src.string()
            if key in metadata:
                raise ValueError(f"duplicate metadata key {key!r}")
            (kind,) = src.unpack("I")
            metadata[key] = _value(src, GGUFValueType(kind), strings)
        described = [_tensor(src) for _ in range(num_tensors)]
    finally:
        src.file.close()
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"invalid general.alignment {alignment!r}: must be a power of two")
    start = -(-src.pos // alignment) * alignment
    tensors, names = [], set()
    for name, dims, kind, offset in described:
        if name in names:
            raise ValueError(f"duplicated tensor {name!r}")
        names.add(name)
        info = _info(name, dims, kind, start + offset)
        if info.data_offset + info.data_dtype.itemsize * int(np.prod(info.data_shape)) > src.size:
            raise EOFError(f"tensor {name!r} runs past the end of the file")
        tensors.append(info)
    return metadata, tensors


def _value(src: _Bytes, kind: GGUFValueType, strings: bool = True):
    if kind == GGUFValueType.STRING:
        return src.string()
    if kind in _SCALARS:
        return src.unpack(_SCALARS[kind])[0]
    if kind == GGUFValueType.ARRAY:
        item, count = src.unpack("IQ")
        item = GGUFValueType(item)
        if item in _SCALARS:
            return src.array(_SCALARS[item], count)
        if item == GGUFValueType.STRING and not strings:
            src.skip_strings(count)
            return UnreadStrings(count)
        values = [_value(src, item) for _ in range(count)]  # nested arrays whole: they are flattened below
        # GGUFReader flattens nested arrays into one list of their items
        return [v for sub in values for v in sub] if item == GGUFValueType.ARRAY else values
    raise ValueError(f"unknown metadata type {kind}")


def _tensor(src: _Bytes) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
    name = src.string()
    (num_dims,) = src.unpack("I")
    dims = src.unpack("Q" * num_dims)
    kind, offset = src.unpack("IQ")
    return name, tuple(dims), GGMLQuantizationType(kind), offset


def _info(name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, offset: int) -> TensorInfo:
    shape = tuple(reversed(dims))
    if kind in _ELEMENTS:
        return TensorInfo(name, kind, dims, offset, np.dtype(_ELEMENTS[kind]), shape)
    block, size = GGML_QUANT_SIZES[kind]
    if shape[-1] % block:
        raise ValueError(f"tensor {name!r}: row length {shape[-1]} is not a multiple of {kind.name}'s block "
                         f"of {block}")
    return TensorInfo(name, kind, dims, offset, np.dtype(np.uint8), (*shape[:-1], shape[-1] // block * size))
