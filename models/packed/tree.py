"""An object tree <-> (a JSON-able description, its numpy arrays): how the packed cache stores whatever the
engine loads (the spec, the planned ModelWeights with every matrix container).

Generic over dataclasses: a container class stores its init fields and is rebuilt by calling the class with
them (so __post_init__ recomputes its init=False fields and checks them again); a new matrix class of
arrays and ints needs no code here. Stored besides: numpy arrays (by index into the array list; a
non-contiguous one as a C-contiguous copy), numpy scalars, tuples, lists, dicts with str keys, str, int,
float, bool and None. An object met twice is stored once and comes back as one object (a tied LM head is
the embedding itself). Anything else raises Unstorable naming where it is, and the caller stores nothing.

A class is named "module:QualName" and resolved only if its module is already imported or lies in one of
numaserve's packages (PACKAGES): a cache entry cannot make the loader import arbitrary code.
"""

import dataclasses
import importlib
import sys
from typing import Any

import numpy as np

PACKAGES = ("memory", "models", "kernels")
_PLAIN = (bool, int, float, str)  # stored as JSON values


class Unstorable(ValueError):
    """The tree holds something the cache cannot store; the message says what and where."""


def flatten(obj: Any) -> tuple[Any, list[np.ndarray]]:
    """-> (description, arrays): the description is JSON-able and refers to arrays by index."""
    arrays: list[np.ndarray] = []
    array_ids: dict[int, int] = {}  # id(array) -> its index
    objects: dict[int, int] = {}  # id(dataclass instance) -> its number, in the order they are finished
    started: set[int] = set()  # id(dataclass instance) of those begun (a cycle meets one unfinished)

    def add_array(a: np.ndarray, where: str) -> int:
        if a.dtype.hasobject or a.dtype.fields is not None:
            raise Unstorable(f"{where}: a numpy array of dtype {a.dtype} (only plain numeric dtypes)")
        index = array_ids.get(id(a))
        if index is None:
            index = array_ids[id(a)] = len(arrays)
            arrays.append(a if a.flags.c_contiguous else a.copy(order="C"))  # (ascontiguousarray: 0-d -> 1-d)
        return index

    def encode(x: Any, where: str) -> Any:
        if x is None or type(x) in _PLAIN:  # exact types: a subclass (an enum, np.float64) is not plain
            return x
        if isinstance(x, np.ndarray):
            return {"array": add_array(x, where)}
        if isinstance(x, np.generic) and not x.dtype.hasobject:
            return {"scalar": x.dtype.str, "value": x.item()}
        if isinstance(x, tuple):
            return {"tuple": [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [encode(v, f"{where}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, dict):
            if not all(isinstance(k, str) for k in x):
                raise Unstorable(f"{where}: a dict with keys that are not str")
            return {"dict": {k: encode(v, f"{where}[{k!r}]") for k, v in x.items()}}
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            if id(x) in objects:
                return {"ref": objects[id(x)]}
            if id(x) in started:
                raise Unstorable(f"{where}: a {type(x).__name__} that contains itself")
            started.add(id(x))
            fields = {f.name: encode(getattr(x, f.name), f"{where}.{f.name}")
                      for f in dataclasses.fields(x) if f.init}
            objects[id(x)] = len(objects)
            return {"dataclass": f"{type(x).__module__}:{type(x).__qualname__}", "fields": fields}
        raise Unstorable(f"{where}: a {type(x).__module__}.{type(x).__qualname__} (the cache stores "
                         "dataclasses, numpy arrays, tuples, lists, dicts, str, numbers and None)")

    return encode(obj, "model"), arrays


def unflatten(tree: Any, arrays: list[np.ndarray]) -> Any:
    """The object flatten described, rebuilt over arrays (used as they are: zero-copy). Raises ValueError
    (or TypeError from a class's constructor) if the description does not fit the code."""
    objects: list[Any] = []

    def decode(x: Any) -> Any:
        if x is None or type(x) in _PLAIN:
            return x
        if isinstance(x, list):
            return [decode(v) for v in x]
        tag = next(iter(x))
        value = x[tag]
        if tag == "array":
            return arrays[value]
        if tag == "scalar":
            return np.dtype(value).type(x["value"])
        if tag == "tuple":
            return tuple(decode(v) for v in value)
        if tag == "dict":
            return {k: decode(v) for k, v in value.items()}
        if tag == "ref":
            return objects[value]
        if tag == "dataclass":
            obj = _dataclass(value)(**{k: decode(v) for k, v in x["fields"].items()})
            objects.append(obj)
            return obj
        raise ValueError(f"unknown tag {tag!r} in a packed tree")

    return decode(tree)


def _dataclass(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    module = sys.modules.get(module_name)
    if module is None:
        if module_name.split(".")[0] not in PACKAGES:
            raise ValueError(f"{name}: not a numaserve class; refusing to import {module_name}")
        module = importlib.import_module(module_name)
    cls = module
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ValueError(f"{name} is not a dataclass")
    return cls
