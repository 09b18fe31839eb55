"""One packed-cache entry on disk: a header, a JSON manifest, then every array's bytes (the blob).

    MAGIC [8] | manifest bytes [u64] | manifest checksum [u64] | manifest (JSON, UTF-8) |
    zeros to a multiple of 4096, then STREAM_OFFSET (16) more | blob: each array at a 64-byte aligned offset
    from its start, zeros between

The manifest says, for each array, its dtype, shape, offset in the blob, bytes and checksum
(kernels/checksum.py), and carries the caller's fields (the key, the object tree). Manifest and blob share
one file so that one rename publishes both: a reader sees a whole entry or none, and a manifest can never
describe another build's blob. JSON rather than msgpack: a model's manifest (most of it its tokenizer.json as
a string) parses in a small fraction of its blob's read, and stays readable with `head -c`; msgpack would not
earn its dependency.

Reading is one sequential pass into one buffer of process memory (huge pages: the kernels stream weights
faster from them), then zero-copy views of it. Or it maps the file (mapped=True): the arrays are views of a
private mapping of it, so a load copies nothing and the weights' pages are the page cache's, faulted in by a
second thread while the first parses the manifest (numba starts there), then bound with mbind to the NUMA
nodes the loading thread's memory is bound to (memory/numa.py: a worker's node; pages cached elsewhere move
there as far as the kernel can); a write to an array copies only its page, never reaches the file. The page
cache's pages are huge where the kernel keeps a file's cache in large folios (ext4 and XFS on recent Linux:
77% of a 1.17 GB entry's mapping PMD-mapped on Linux 6.18 ext4), else 4 KB, which batch-1 decode measured
0.93x the buffer's speed on an older kernel. mapped="auto" maps and keeps the mapping where at least
HUGE_SHARE of it is on huge pages (/proc/self/smaps' FilePmdMapped), else copies it into a buffer (the read's
cost, no more: its pages were faulted in from the page cache). Either way every array's checksum is verified
(a small fraction of the read); a bad magic, manifest, size or checksum raises CorruptEntry saying which. The
blob starts STREAM_OFFSET bytes past a page, so that in a mapping, as in the buffer, every array starts where
kernels/placement.py places weight streams.
"""

import json
import mmap
import os
import struct
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from kernels.checksum import weighted_sum, weighted_sum_parallel
from kernels.placement import STREAM_OFFSET, stream_empty
from memory.numa import bind_range_as_thread
from memory.smaps import mapping_at

MAGIC = b"NSPACK\x00\x01"
_HEADER = struct.Struct("<8sQQ")
_BLOB_ALIGN = 4096  # the blob starts STREAM_OFFSET bytes past a page
_PAGE = 4096
_HUGE = 2 << 20  # a huge page (x86-64's PMD)
_ARRAY_ALIGN = 64  # each array at a whole number of cache lines from the blob's start, the blob in memory
# where kernels/placement.py puts weight streams: every array lands there
_READ_BYTES = 1 << 30  # per read call (Linux caps one below 2 GiB); short reads are retried
HUGE_SHARE = 0.5  # mapped="auto" keeps a mapping with at least this share of its bytes on huge pages


class CorruptEntry(ValueError):
    """The entry's bytes are not what its manifest says: truncated, overwritten or not an entry."""


def checksum(data: np.ndarray) -> int:
    """Of a C-contiguous array's bytes, zero-padded to whole 8-byte words."""
    b = data.reshape(-1).view(np.uint8)
    whole = len(b) // 8 * 8
    words = b[:whole].view(np.uint64)
    s = int(weighted_sum_parallel(words, 0))
    if whole < len(b):
        tail = np.zeros(8, np.uint8)
        tail[:len(b) - whole] = b[whole:]
        s += int(weighted_sum(tail.view(np.uint64), whole // 8))
    return s % (1 << 64)


def write_entry(path: Path, fields: dict, arrays: list[np.ndarray]) -> int:
    """Write fields (JSON-able) and arrays (C-contiguous) as an entry at path: into a temp file beside it,
    then renamed over it, so concurrent writers of one entry each publish a whole one (the last stays).
    -> bytes written. Raises OSError (an unwritable or full disk) with no temp file left behind."""
    offsets, end = [], 0
    for a in arrays:
        offsets.append(end)
        end = _aligned(end + a.nbytes, _ARRAY_ALIGN)
    described = [{"dtype": a.dtype.str, "shape": list(a.shape), "offset": o, "nbytes": a.nbytes,
                  "checksum": checksum(a)} for a, o in zip(arrays, offsets)]
    manifest = json.dumps(fields | {"arrays": described, "blob_bytes": end}).encode()
    head = _HEADER.pack(MAGIC, len(manifest), checksum(np.frombuffer(manifest, np.uint8))) + manifest
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb", buffering=0) as raw:
            f = _HugeChunks(raw)
            f.write(head + bytes(_blob_start(len(head)) - len(head)))
            for a, o, d in zip(arrays, offsets, described):
                f.write(memoryview(a.reshape(-1).view(np.uint8)))
                f.write(bytes(_aligned(o + d["nbytes"], _ARRAY_ALIGN) - o - d["nbytes"]))
            size = f.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


class _HugeChunks:
    """Writes a file in whole, aligned huge pages' worth (_HUGE bytes at multiples of _HUGE; the last one
    short), through one staging buffer: the page cache then holds the file in huge folios where the kernel
    keeps large folios (a write's folios are as large as its length and offset allow), which a mapping maps
    with huge pages. Written as the arrays came, each in pieces: 78% of a 1.17 GB entry's mapping came on
    huge pages on Linux 6.18 ext4, 100% this way."""

    def __init__(self, raw):
        self.raw, self.stage, self.filled, self.written = raw, bytearray(_HUGE), 0, 0

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        while len(data):
            n = min(len(data), _HUGE - self.filled)
            self.stage[self.filled:self.filled + n] = data[:n]
            self.filled, data = self.filled + n, data[n:]
            if self.filled == _HUGE:
                self._flush()

    def close(self) -> int:
        """-> the bytes written."""
        self._flush()
        return self.written

    def _flush(self) -> None:
        view = memoryview(self.stage)[:self.filled]
        while len(view):  # short writes are retried
            n = self.raw.write(view)
            view = view[n:]
        self.written += self.filled
        self.filled = 0


@dataclass(frozen=True)
class Entry:
    fields: dict  # as written
    arrays: list[np.ndarray]  # views of one buffer of this process's, or of a private mapping of the file
    mapped: bool
    why: str  # why mapped or read, for the decision log


def read_entry(path: Path, meanwhile: Callable[[dict], None] | None = None,
               mapped: bool | Literal["auto"] = False) -> Entry:
    """The fields written and the arrays, views of one buffer the file was read into, or of a mapping of it
    (mapped; "auto": where the mapping is mostly on huge pages), checksums verified. meanwhile(fields), if
    given, runs on this thread while a second one faults in or reads the blob. Raises CorruptEntry, or
    OSError (FileNotFoundError: no entry).

    The blob's mapping or read starts as soon as the header gives its place, in a thread of its own (faults
    and reads release the GIL; its pages are touched from this process, so a pinned worker's land on its
    node); this thread meanwhile verifies and parses the manifest, which is where numba first starts in a
    process (its checksum kernel, and numba's own set-up with it), and runs meanwhile: a start waits for the
    longer of the two, not their sum."""
    with open(path, "rb", buffering=0) as f, ThreadPoolExecutor(1) as reader:
        size = os.fstat(f.fileno()).st_size
        magic, manifest_bytes, manifest_sum = _HEADER.unpack(_read_exactly(f, _HEADER.size, path))
        if magic != MAGIC:
            raise CorruptEntry(f"{path}: not a packed-cache entry (magic {magic!r})")
        blob_start = _blob_start(_HEADER.size + manifest_bytes)
        if blob_start > size:
            raise CorruptEntry(f"{path}: truncated inside its manifest ({size} bytes)")
        raw = _read_exactly(f, manifest_bytes, path)
        blob_bytes = size - blob_start
        if mapped:  # True or "auto": (buffer, NUMA binding)
            reading = reader.submit(_map, f, blob_start, blob_bytes)
        else:
            reading = reader.submit(lambda: (_read_into(path, blob_start, _aligned_buffer(blob_bytes)), ""))
        try:
            fields = _manifest(raw, manifest_sum, path)
            if fields.pop("blob_bytes") != blob_bytes:
                raise CorruptEntry(f"{path}: {size} bytes, its manifest describes {blob_start + blob_bytes}")
            if meanwhile is not None:
                meanwhile(fields)
        finally:
            failed = reading.exception()  # waits for the read: the buffer is not handed on half-filled
        if failed is not None:
            raise failed
        buf, binding = reading.result()
    why, kept = "into memory of its own", bool(mapped)
    if mapped:
        share = huge_page_share(buf)
        why = f"{share:.0%} of the mapping on huge pages, NUMA {binding}"
        if mapped == "auto" and share < HUGE_SHARE:  # 4 KB pages: decode would read the weights slower
            why, kept = f"{why}, under {HUGE_SHARE:.0%}: copied into memory of its own", False
            buf = _copied(buf)
    arrays = []
    for i, d in enumerate(fields.pop("arrays")):
        a = buf[d["offset"]:d["offset"] + d["nbytes"]].view(np.dtype(d["dtype"])).reshape(d["shape"])
        if checksum(a) != d["checksum"]:
            raise CorruptEntry(f"{path}: array {i} ({d['dtype']} {d['shape']}) fails its checksum")
        arrays.append(a)
    return Entry(fields, arrays, kept, why)


def huge_page_share(buf: np.ndarray, smaps: str | None = None) -> float:
    """The share of buf's mapping (the one holding its first byte, per smaps: /proc/self/smaps' text) that
    the kernel maps with huge pages: FilePmdMapped (file pages) plus AnonHugePages over its resident bytes;
    0 where smaps is unreadable."""
    held = mapping_at(buf.ctypes.data, smaps)
    kb = {} if held is None else held.kb
    rss = kb.get("Rss", 0)
    return 0.0 if rss == 0 else (kb.get("FilePmdMapped", 0) + kb.get("AnonHugePages", 0)) / rss


def _copied(buf: np.ndarray) -> np.ndarray:
    copy = _aligned_buffer(len(buf))
    np.copyto(copy, buf)
    return copy


def _manifest(raw: bytes, manifest_sum: int, path: Path) -> dict:
    if checksum(np.frombuffer(raw, np.uint8)) != manifest_sum:
        raise CorruptEntry(f"{path}: its manifest's checksum does not match")
    return json.loads(raw)


def _read_into(path: Path, offset: int, buf: np.ndarray) -> np.ndarray:
    # buf <- the file's bytes from offset, through a file of its own (no shared position with the caller's)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view, done = memoryview(buf), 0
        while done < len(buf):
            n = f.readinto(view[done:done + _READ_BYTES])
            if not n:
                raise CorruptEntry(f"{path}: ended {len(buf) - done} bytes short of its blob while read")
            done += n
    return buf


def _map(f, offset: int, nbytes: int) -> tuple[np.ndarray, str]:
    """(uint8 [nbytes]: the file's bytes from offset, a private writable mapping (copy on write: numba's
    kernels take writable arrays), every page faulted in: read once, a byte a page (numpy's loop releases
    the GIL), so the pages are the page cache's own, not copies; how the mapping is bound to NUMA nodes).

    Pages read from disk by the fault land where this thread's memory is bound (a worker's: its node's); the
    mapping is then bound to the same nodes with mbind, which moves there the pages the page cache already
    held elsewhere (read by a process on another node) as far as the kernel can: one another process maps
    too stays where it is."""
    mapping = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # pages not cached yet are read into huge folios, mapped huge
        mapping.madvise(mmap.MADV_HUGEPAGE)
    mapping.madvise(mmap.MADV_WILLNEED)
    buf = np.frombuffer(mapping, np.uint8, nbytes, offset)
    np.bitwise_or.reduce(buf[::_PAGE])
    return buf, bind_range_as_thread(buf.ctypes.data - offset, len(mapping))


def _read_exactly(f, n: int, path: Path) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptEntry(f"{path}: truncated ({len(data)} of {n} bytes of its header read)")
    return data


def _blob_start(head_bytes: int) -> int:
    return _aligned(head_bytes, _BLOB_ALIGN) + STREAM_OFFSET


def _aligned(n: int, align: int) -> int:
    return -(-n // align) * align


def _aligned_buffer(nbytes: int) -> np.ndarray:
    """uint8 [nbytes] starting where kernels/placement.py places weight streams (a cache line + 16 bytes)."""
    return stream_empty((nbytes,), np.uint8)
