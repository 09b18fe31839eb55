"""The bytes rank 0 sends its followers (the step's order through the group's segment, adapters through a
follower's pipe), as msgpack: a record is one of RECORDS by name with its fields in order, an array its dtype,
shape and bytes, a tuple stays a tuple. A follower rebuilds those types and nothing else (no pickle: what it
reads cannot name code to run)."""

import dataclasses
from functools import partial

import msgpack
import numpy as np

from models.batch import ForwardBatch
from models.lora.adapter import LoraAdapter, LoraModule
from models.tensor_parallel.orders import ForwardOrder, LoraOrder, MergedOrder, StopOrder

RECORDS = {cls.__name__: cls for cls in (ForwardOrder, StopOrder, LoraOrder, MergedOrder, ForwardBatch,
                                         LoraAdapter, LoraModule)}
_ARRAY, _RECORD, _TUPLE = 1, 2, 3


def _default(obj):
    if isinstance(obj, np.ndarray):
        a = np.ascontiguousarray(obj)
        return msgpack.ExtType(_ARRAY, _pack([a.dtype.str, list(a.shape), a.tobytes()]))
    if isinstance(obj, tuple):
        return msgpack.ExtType(_TUPLE, _pack(list(obj)))
    if isinstance(obj, np.generic):
        return obj.item()
    name = type(obj).__name__
    if dataclasses.is_dataclass(obj) and RECORDS.get(name) is type(obj):
        values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return msgpack.ExtType(_RECORD, _pack([name, values]))
    raise TypeError(f"{name} is not part of what rank 0 sends its followers")


def _ext(code: int, data: bytes):
    if code == _ARRAY:
        dtype, shape, raw = _unpack(data)
        return np.frombuffer(raw, np.dtype(dtype)).reshape(shape).copy()  # writable, as the sender's
    if code == _TUPLE:
        return tuple(_unpack(data))
    if code == _RECORD:
        name, values = _unpack(data)
        if name not in RECORDS:
            raise ValueError(f"{name!r} is not a record rank 0 sends")
        return RECORDS[name](*values)
    raise ValueError(f"unknown msgpack extension {code}")


_pack = partial(msgpack.packb, default=_default, strict_types=True, use_bin_type=True)
_unpack = partial(msgpack.unpackb, ext_hook=_ext, raw=False, strict_map_key=False)


def encode(obj) -> bytes:
    return _pack(obj)


def decode(data: bytes):
    return _unpack(data)
