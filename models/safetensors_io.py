"""Read safetensors files into process memory (no long-lived mmap: the VM reclaims idle file pages).

The numpy framework of the safetensors package cannot represent bfloat16, so we read the format
ourselves: an 8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

import json
import struct
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from kernels.formats.bf16 import from_bf16

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}
_INT_DTYPES = {"I64": np.int64, "I32": np.int32}  # index tensors (an EAGLE head's draft vocabulary)


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str  # safetensors dtype tag
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int
    name: str = ""


_MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def read_header(path: Path) -> dict[str, TensorEntry]:
    """Every tensor's entry, checked against the file: a header that lies (sizes, offsets, shapes) is refused
    here, before anything is allocated for it."""
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            file_size = path.stat().st_size
            if header_len > min(_MAX_HEADER_BYTES, file_size - 8):
                raise ValueError(f"its header length {header_len} runs past the {file_size}-byte file")
            header = json.loads(f.read(header_len))
        if not isinstance(header, dict):
            raise TypeError(f"its header is a JSON {type(header).__name__}, not an object")
    # JSONDecodeError and UnicodeDecodeError are ValueErrors
    except (OSError, ValueError, TypeError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); if it was copied or "
                              "downloaded, check that it is complete, or re-save the model with "
                              "save_pretrained(dir, safe_serialization=True)") from None
    data_size = file_size - 8 - header_len
    return {name: _entry(path, name, info, 8 + header_len, data_size)
            for name, info in header.items() if name != "__metadata__"}


def _entry(path: Path, name: str, info, data_start: int, data_size: int) -> TensorEntry:
    def bad(problem: str) -> CheckpointError:
        return CheckpointError(f"{path}: tensor {name!r} {problem}; the file is corrupt: "
                               "re-download or re-save it")

    def ints(value) -> bool:
        return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)

    if not isinstance(info, dict) or not isinstance(info.get("dtype"), str):
        raise bad(f"has a malformed header entry {str(info)[:80]!r} (expected dtype, shape, data_offsets)")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not ints(shape):
        raise bad(f"has shape {shape!r}; expected a list of non-negative ints")
    if not ints(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise bad(f"has data_offsets {offsets!r}; expected [begin, end] with begin <= end")
    start, end = offsets
    if end > data_size:
        raise bad(f"ends at byte {end} of the data but the file holds {data_size} data bytes (truncated?)")
    np_dtype = _DTYPES.get(info["dtype"], _INT_DTYPES.get(info["dtype"]))
    if (np_dtype is not None
            and (want := int(np.prod(shape, dtype=object)) * np.dtype(np_dtype).itemsize) != end - start):
        raise bad(f"has shape {tuple(shape)} of {info['dtype']} ({want} bytes) but its data range holds "
                  f"{end - start} bytes")
    return TensorEntry(path, info["dtype"], tuple(shape), data_start + start, end - start, name)


def read_tensor(entry: TensorEntry, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor as float32 (copied into process memory), or only its rows [lo, hi) (a tensor-parallel
    rank's shard: only those bytes are read); a NaN or inf value is refused by name (a flipped bit in an
    exponent would otherwise surface as NaN logits far from its cause; min and max cost little beside the
    read)."""
    np_dtype = _DTYPES.get(entry.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{entry.path}: tensor dtype {entry.dtype} is not supported; "
                              "store weights as float32, float16 or bfloat16")
    if rows is not None:
        lo, hi = rows
        row_bytes = entry.nbytes // max(1, entry.shape[0])
        entry = replace(entry, shape=(hi - lo, *entry.shape[1:]), offset=entry.offset + lo * row_bytes,
                        nbytes=(hi - lo) * row_bytes)
    raw = _read_raw(entry, np_dtype)
    out = from_bf16(raw) if entry.dtype == "BF16" else raw.astype(np.float32, copy=False)
    if out.size and not (np.isfinite(out.min()) and np.isfinite(out.max())):
        raise CheckpointError(f"{entry.path}: tensor {entry.name!r} holds NaN or inf values; the file is "
                              "corrupt (or the training diverged): re-download or re-save it")
    return out


def read_int_tensor(entry: TensorEntry) -> np.ndarray:
    """An integer tensor (I64 or I32) as int64, copied into process memory."""
    np_dtype = _INT_DTYPES.get(entry.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{entry.path}: tensor {entry.name!r} is {entry.dtype}; it holds indices: "
                              "store it as int64 (I64) or int32 (I32)")
    return _read_raw(entry, np_dtype).astype(np.int64, copy=False)


def _read_raw(entry: TensorEntry, np_dtype) -> np.ndarray:
    raw = np.empty(entry.nbytes // np.dtype(np_dtype).itemsize, np_dtype)
    with open(entry.path, "rb") as f:
        f.seek(entry.offset)
        if f.readinto(memoryview(raw).cast("B")) != entry.nbytes:
            raise CheckpointError(f"{entry.path}: file is truncated; re-download or re-save it")
    return raw.reshape(entry.shape)
