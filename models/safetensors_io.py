"""Read safetensors files into process memory (no long-lived mmap: the VM reclaims idle file pages).

The numpy framework of the safetensors package cannot represent bfloat16, so we read the format
ourselves: an 8-byte little-endian header length, a JSON header, then raw little-endian tensor bytes.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from kernels.bf16 import from_bf16

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str  # safetensors dtype tag
    shape: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int


def read_header(path: Path) -> dict[str, TensorEntry]:
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); re-save the model with "
                              "save_pretrained(dir, safe_serialization=True)") from None
    entries = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        entries[name] = TensorEntry(path, info["dtype"], tuple(info["shape"]), 8 + header_len + start, end - start)
    return entries


def read_tensor(entry: TensorEntry) -> np.ndarray:
    """The tensor as float32 (copied into process memory)."""
    np_dtype = _DTYPES.get(entry.dtype)
    if np_dtype is None:
        raise CheckpointError(f"{entry.path}: tensor dtype {entry.dtype} is not supported; "
                              "store weights as float32, float16 or bfloat16")
    raw = np.empty(entry.nbytes // np.dtype(np_dtype).itemsize, np_dtype)
    with open(entry.path, "rb") as f:
        f.seek(entry.offset)
        if f.readinto(memoryview(raw).cast("B")) != entry.nbytes:
            raise CheckpointError(f"{entry.path}: file is truncated; re-download or re-save it")
    raw = raw.reshape(entry.shape)
    if entry.dtype == "BF16":
        return from_bf16(raw)
    return raw.astype(np.float32, copy=False)
