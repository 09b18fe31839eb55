"""One packed-cache entry (models/packed/file.py), mapped and read: what comes back is what was written, every
array where kernels/placement.py places weight streams; a mapped one lies in a private mapping of the entry
(nothing copied, a write never reaching the file); mapped="auto" keeps the mapping where smaps says it is
mostly on huge pages, else a copy, and binds it to the NUMA nodes the loading thread's memory is bound to;
any damage to the file raises CorruptEntry every way."""

import json
import os
import re
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kernels.placement import LINE, STREAM_OFFSET
from memory import numa
from models.packed import file
from models.packed.file import HUGE_SHARE, CorruptEntry, huge_page_share, read_entry, write_entry

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


@pytest.mark.parametrize("mapped", [True, False, "auto"])
def test_what_is_read_is_what_was_written_placed_for_the_kernels(tmp_path, mapped):
    entry = read_entry(write(tmp_path), mapped=mapped)
    assert entry.fields == FIELDS
    for a, b in zip(entry.arrays, arrays(), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert a.flags.writeable and a.flags.c_contiguous
        if a.size:
            assert a.ctypes.data % LINE == STREAM_OFFSET


def test_a_mapped_entry_is_not_copied_and_a_write_stays_in_the_process(tmp_path):
    path = write(tmp_path)
    before = path.read_bytes()
    entry = read_entry(path, mapped=True)
    got = entry.arrays
    assert entry.mapped and all(mapping_of(a.ctypes.data) == str(path) for a in got if a.size)
    got[0][0, 0] ^= 1  # copy on write: this page becomes the process's own
    assert got[0][0, 0] == arrays()[0][0, 0] ^ 1
    assert path.read_bytes() == before
    read = read_entry(path, mapped=False)
    assert not read.mapped and mapping_of(read.arrays[0].ctypes.data) != str(path)


@pytest.mark.parametrize("share", [0.0, HUGE_SHARE - 0.01, HUGE_SHARE, 1.0])
def test_auto_keeps_the_mapping_only_where_it_is_mostly_on_huge_pages(tmp_path, monkeypatch, share):
    path = write(tmp_path)
    monkeypatch.setattr(file, "huge_page_share", lambda buf: share)
    entry = read_entry(path, mapped="auto")
    kept = share >= HUGE_SHARE
    assert entry.mapped == kept and f"{share:.0%} of the mapping on huge pages" in entry.why
    assert all((mapping_of(a.ctypes.data) == str(path)) == kept for a in entry.arrays if a.size)
    for a, b in zip(entry.arrays, arrays(), strict=True):
        assert np.array_equal(a, b) and a.flags.writeable
        if a.size:
            assert a.ctypes.data % LINE == STREAM_OFFSET


SMAPS = """\
7f0000000000-7f0000200000 r--p 00000000 fe:00 11 /usr/lib/libc.so.6
Rss:                2048 kB
FilePmdMapped:      2048 kB
VmFlags: rd mr mw me
7fbc26c00000-7fbc6c80f000 rw-p 00000000 fe:00 2884429                    /cache/entry.packed
Size:            1142844 kB
Rss:             1142844 kB
AnonHugePages:         0 kB
FilePmdMapped:    880640 kB
VmFlags: rd wr mr mw me ac
7fbc6c80f000-7fbc6c810000 rw-p 00000000 00:00 0
Rss:                   4 kB
AnonHugePages:         0 kB
"""


def test_the_huge_page_share_is_read_from_the_mapping_holding_the_buffer():
    class At:  # what huge_page_share reads of an array: its address
        def __init__(self, address: int):
            self.ctypes = type("C", (), {"data": address})()

    assert huge_page_share(At(0x7fbc26c02010), SMAPS) == 880640 / 1142844
    assert huge_page_share(At(0x7f00001fffff), SMAPS) == 1.0
    assert huge_page_share(At(0x7fbc6c80f000), SMAPS) == 0.0
    assert huge_page_share(At(0x1000), SMAPS) == 0.0  # in no mapping
    assert 0.0 <= huge_page_share(np.zeros(1 << 20, np.uint8)) <= 1.0  # this process's own smaps


def _blob_start(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    _, size, _ = struct.unpack("<8sQQ", data[:24])
    return -(-(24 + size) // 4096) * 4096 + 16, json.loads(data[24:24 + size])


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mapped", [True, False, "auto"])
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


class ShortWrites:
    """A raw file that takes at most `most` bytes a write call, recording each call's (offset, length)."""

    def __init__(self, most: int):
        self.most, self.calls, self.data = most, [], bytearray()

    def write(self, view) -> int:
        n = min(len(view), self.most)
        self.calls.append((len(self.data), n))
        self.data += bytes(view[:n])
        return n


@pytest.mark.parametrize("most", [file._HUGE, 3 << 20, 12345])
def test_an_entry_is_written_in_whole_aligned_huge_pages(most):
    raw = ShortWrites(most)
    chunks = file._HugeChunks(raw)
    pieces = [b"h" * 4112, np.arange(1_500_000, dtype=np.int32), b"", b"\0" * 48, np.ones(700_001, np.uint8)]
    for piece in pieces:
        chunks.write(piece)
    expected = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    assert chunks.close() == len(expected) and bytes(raw.data) == expected
    # every call but the last's retries starts where a huge page does, or retries the rest of one
    starts = [offset for offset, _ in raw.calls]
    firsts = {offset for offset in starts if offset % file._HUGE == 0}
    assert firsts == set(range(0, len(expected), file._HUGE))
    assert all(offset // file._HUGE == (offset + n - 1) // file._HUGE for offset, n in raw.calls)


def test_a_mapped_entry_is_bound_to_the_nodes_the_loading_threads_memory_is(tmp_path):
    # in a process of its own: a worker binds its memory (memory/numa.py bind_memory) before it loads
    if (numa.memory_policy() or (0,))[0] == numa.MPOL_BIND:
        pytest.skip("this process's memory is bound already (numactl --membind?): no unbound thread to test")
    path = write(tmp_path)
    code = textwrap.dedent(f"""
        from memory import numa
        from models.packed.file import read_entry
        unbound = read_entry({str(path)!r}, mapped=True)
        print(unbound.why, "|", numa.memory_policy(unbound.arrays[0].ctypes.data))
        print(numa.bind_memory([0]))
        bound = read_entry({str(path)!r}, mapped=True)
        print(bound.why, "|", numa.memory_policy(bound.arrays[0].ctypes.data))
    """)
    root = Path(__file__).parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env=os.environ | {"PYTHONPATH": str(root)}).stdout.splitlines()
    unbound, binding, bound = out
    if binding != "bind:0":  # no libnuma here: both left to first touch, and say so
        assert "NUMA first-touch (" in unbound and "NUMA first-touch (" in bound
        return
    assert "NUMA first-touch (this thread's memory is not bound)" in unbound and unbound.endswith("| (0, [])")
    assert "NUMA bind:0" in bound and bound.endswith(f"| ({numa.MPOL_BIND}, [0])")
