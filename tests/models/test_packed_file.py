"""One packed-cache entry (models/packed/file.py), mapped and read: what comes back is what was written, every
array where kernels/placement.py places weight streams; a mapped one lies in a private mapping of the entry
(nothing copied, a write never reaching the file); any damage to the file raises CorruptEntry either way."""

import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from kernels.placement import LINE, STREAM_OFFSET
from models.packed.file import CorruptEntry, read_entry, write_entry

FIELDS = {"key": {"model": "m"}, "tree": [1, "two"]}


def arrays() -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.integers(-128, 128, (10, 100), dtype=np.int8), rng.standard_normal((3, 7), dtype=np.float32),
            np.zeros(0, np.float32), rng.integers(0, 1 << 16, 5000, dtype=np.uint16),
            np.array(2.5, np.float64)]


def write(tmp_path: Path) -> Path:
    path = tmp_path / "entry.packed"
    write_entry(path, FIELDS, arrays())
    return path


def mapping_of(address: int) -> str | None:
    """The path of the file mapped at address in this process (None: anonymous memory or unmapped)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= address < end:
            return parts[5] if len(parts) == 6 else None
    return None


@pytest.mark.parametrize("mapped", [True, False])
def test_what_is_read_is_what_was_written_placed_for_the_kernels(tmp_path, mapped):
    fields, got = read_entry(write(tmp_path), mapped=mapped)
    assert fields == FIELDS
    for a, b in zip(got, arrays(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert a.flags.writeable and a.flags.c_contiguous
        if a.size:
            assert a.ctypes.data % LINE == STREAM_OFFSET


def test_a_mapped_entry_is_not_copied_and_a_write_stays_in_the_process(tmp_path):
    path = write(tmp_path)
    before = path.read_bytes()
    _, got = read_entry(path, mapped=True)
    assert all(mapping_of(a.ctypes.data) == str(path) for a in got if a.size)
    got[0][0, 0] ^= 1  # copy on write: this page becomes the process's own
    assert got[0][0, 0] == arrays()[0][0, 0] ^ 1
    assert path.read_bytes() == before
    _, read = read_entry(path, mapped=False)
    assert mapping_of(read[0].ctypes.data) != str(path)


def _blob_start(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    _, size, _ = struct.unpack("<8sQQ", data[:24])
    return -(-(24 + size) // 4096) * 4096 + 16, json.loads(data[24:24 + size])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("damage, problem", [
    ("truncated in its blob", "its manifest describes"), ("truncated in its manifest", "truncated"),
    ("bytes appended", "its manifest describes"),
    ("a blob byte changed", "array 3 (<u2 [5000]) fails its checksum"),
    ("another entry over it", "array 0 (|i1 [10, 100]) fails its checksum")])
def test_a_damaged_entry_raises_corrupt_entry(tmp_path, mapped, damage, problem):
    path = write(tmp_path)
    blob, manifest = _blob_start(path)
    if damage == "truncated in its blob":
        os.truncate(path, path.stat().st_size - 100)
    elif damage == "truncated in its manifest":
        os.truncate(path, 100)
    elif damage == "bytes appended":
        with open(path, "ab") as f:
            f.write(b"\0" * 64)
    elif damage == "a blob byte changed":
        last = manifest["arrays"][3]
        _flip(path, blob + last["offset"] + last["nbytes"] - 1)
    else:  # arrays of the same shapes and other values: the manifest no longer describes the blob
        other = tmp_path / "other.packed"
        write_entry(other, FIELDS, [np.flip(a).copy() if a.ndim else a for a in arrays()])
        data = bytearray(path.read_bytes())
        data[blob:] = other.read_bytes()[blob:]
        path.write_bytes(bytes(data))
    with pytest.raises(CorruptEntry, match=re.escape(problem)):
        read_entry(path, mapped=mapped)
