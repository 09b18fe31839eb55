"""KV block files: the prefix cache's disk tier on disk (scheduling/disk_tier.py runs it).

    ROOT/usage                  bytes of every file below, as the writers counted them (under ROOT/.lock)
    ROOT/<identity>/<name>.kv   one full KV block (identity: the model, its KV layout, this format's version)

A file:  MAGIC | u32 header length | header (JSON) | payload | u32 crc32 of everything before it.
The header names the identity and the block's key (parent hash, token ids, what else keys it: adapter,
cache salt) and the payload's parts (dtype, shape): the block's codes and scales in KVCache.block_parts order,
in the pool's KV dtype. A reader trusts a file only when its size, checksum, identity, key and parts all equal
what it asked for: a truncated, corrupted, foreign or stale file raises BadBlockFile and is removed, never
served.

Writes go to a temp file renamed into place, so a writer killed mid-write leaves only a temp file (never read;
removed once its process is gone). The bound (max_bytes) holds over the whole root for every process sharing
it: under an exclusive lock on ROOT/.lock a writer reserves its bytes in ROOT/usage, first removing the least
recently used files (a read touches its file) when they would not fit. The ledger over-counts at worst (a
writer killed after reserving, a file removed by hand); eviction rescans the files and writes the true sum.
"""

import fcntl
import hashlib
import json
import os
import struct
import time
import uuid
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"NSKVBLK1"  # the file format's version is its last byte
SUFFIX = ".kv"
_HEAD = struct.Struct("<I")
_CRC = struct.Struct("<I")
_STALE_TEMP_SECONDS = 3600.0  # a temp file of a process that cannot be checked is stale after this long
EVICT_TO = 0.9  # eviction leaves the files at this fraction of the bound, so it rescans once per tenth


class BadBlockFile(Exception):
    """A block file that must not be served: truncated, corrupted, another model's, another key's, stale."""


@dataclass(frozen=True)
class BlockKey:
    """What a block file must hold to be served for a block: its chain's parent hash and its tokens, and what
    else decides its KV (the adapter's name and content digest, the cache salt)."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]
    extra: str  # repr of everything else that keys it

    @property
    def name(self) -> str:
        """The file's name within its identity's folder."""
        h = hashlib.blake2b(struct.pack("<q", self.block_hash) + self.extra.encode(), digest_size=16)
        return h.hexdigest()

    def as_json(self) -> list:
        return [self.block_hash, self.parent_hash, list(self.token_ids), self.extra]


def identity_name(identity: dict) -> str:
    """The folder name of an identity (the model's key, the KV layout, the format version)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:40]


def parts_spec(parts: Sequence[np.ndarray]) -> list:
    return [[p.dtype.str, list(p.shape)] for p in parts]


class BlockFiles:
    def __init__(self, root: Path, identity: dict, parts: list, max_bytes: int):
        """root: the disk tier's folder (shared by every model and process using it); parts: parts_spec of a
        block of this layout. Raises OSError if the folder cannot be created."""
        self.root, self.max_bytes = root, max_bytes
        self.identity, self.parts = identity, parts
        self.payload_bytes = sum(np.dtype(d).itemsize * int(np.prod(shape)) for d, shape in parts)
        self.folder = root / identity_name(identity)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._identity_json = json.dumps(identity, sort_keys=True)

    def path(self, key: BlockKey) -> Path:
        return self.folder / (key.name + SUFFIX)

    def exists(self, key: BlockKey) -> bool:
        return os.path.exists(self.path(key))

    def touch(self, key: BlockKey) -> bool:
        """Mark a block's file used now -> whether there is one."""
        try:
            os.utime(self.path(key))
        except OSError:
            return False
        return True

    def file_bytes(self, key: BlockKey) -> int:
        """A block file's size on disk."""
        return len(MAGIC) + _HEAD.size + len(self._header(key)) + self.payload_bytes + _CRC.size

    def write(self, blocks: Sequence[tuple[BlockKey, np.ndarray]]) -> tuple[int, int, int]:
        """Write (key, payload: uint8 [payload_bytes]) blocks not on disk yet, within the bound -> (blocks
        written, their bytes, files evicted). A block larger than the whole bound is not written."""
        todo = [(k, p) for k, p in {k.name: (k, p) for k, p in blocks}.values() if not self.exists(k)]
        sizes = [self.file_bytes(k) for k, _ in todo]
        need = sum(s for s in sizes if s <= self.max_bytes)
        if not need:
            return 0, 0, 0
        with self._locked():
            used = self._read_usage()
            evicted = 0
            if used + need > self.max_bytes:
                used, evicted = self._evict(int(self.max_bytes * EVICT_TO) - need)
            room = self.max_bytes - used
            written, reserved = [], 0
            for (key, payload), size in zip(todo, sizes):
                if reserved + size <= room:
                    written.append((key, payload))
                    reserved += size
            self._write_usage(used + reserved)
        for key, payload in written:  # outside the lock: their bytes are reserved
            self._write_file(key, payload)
        return len(written), reserved, evicted

    def read_into(self, key: BlockKey, parts: Sequence[np.ndarray]) -> int:
        """Read a block file's payload into parts (KVCache.block_parts of the pool block it goes to, reserved
        for it: they hold garbage if the file fails its checks, and the block is then not used) -> bytes read.
        One scatter read straight into the parts, then the checks. Raises FileNotFoundError, or BadBlockFile
        (the file is then removed)."""
        if parts_spec(parts) != self.parts:
            raise ValueError(f"read_into: parts {parts_spec(parts)} are not this layout's {self.parts}")
        path = self.path(key)
        head = MAGIC + _HEAD.pack(len(header := self._header(key))) + header  # what the file must start with
        size = len(head) + self.payload_bytes + _CRC.size
        with open(path, "rb", buffering=0) as f:
            fd = f.fileno()
            on_disk = os.fstat(fd).st_size
            if on_disk == size:
                found = os.pread(fd, len(head), 0)
                views = [memoryview(p).cast("B") for p in parts]
                n = os.preadv(fd, views, len(head))
                tail = os.pread(fd, _CRC.size, size - _CRC.size)
        try:
            if on_disk != size or n != self.payload_bytes or len(tail) != _CRC.size:
                raise BadBlockFile(f"{path}: {on_disk} bytes, a block of this layout and key has {size}")
            crc = zlib.crc32(found)
            for v in views:
                crc = zlib.crc32(v, crc)
            if crc != _CRC.unpack(tail)[0]:
                raise BadBlockFile(f"{path}: checksum mismatch (corrupted)")
            if found != head:
                self._mismatch(path, found)
        except BadBlockFile:
            path.unlink(missing_ok=True)
            raise
        self.touch(key)  # used now: the least recently used go first
        return size

    def sweep(self) -> int:
        """Count the files anew (the ledger then equals them), remove the temp files of writers that are gone
        and the least recently used blocks past the bound (it may have been lowered) -> files removed."""
        with self._locked():
            return self._evict(self.max_bytes)[1]

    def usage(self) -> int:
        """Bytes of block files under the root, as the ledger counts them."""
        with self._locked():
            return self._read_usage()

    def scan(self) -> tuple[int, int]:
        """-> (bytes, files) of the block files under the root, counted from the files themselves."""
        files = [f for f in self._files() if f[2].suffix == SUFFIX]
        return sum(size for _, size, _ in files), len(files)

    # ---- internals -----------------------------------------------------------------------------------------

    def _header(self, key: BlockKey) -> bytes:
        return json.dumps({"identity": self._identity_json, "key": key.as_json(), "parts": self.parts},
                          sort_keys=True).encode()

    def _mismatch(self, path: Path, found: bytes) -> None:
        """Raise BadBlockFile naming how a file whose checksum holds differs from what was asked for."""
        if not found.startswith(MAGIC):
            raise BadBlockFile(f"{path}: not a block file of this version")
        try:
            header = json.loads(found[len(MAGIC) + _HEAD.size:])
        except ValueError:
            header = {}
        if header.get("identity") != self._identity_json:
            raise BadBlockFile(f"{path}: another model's or layout's block")
        if header.get("parts") != self.parts:
            raise BadBlockFile(f"{path}: its parts are not this layout's")
        raise BadBlockFile(f"{path}: another block's KV (key mismatch)")

    def _write_file(self, key: BlockKey, payload: np.ndarray) -> None:
        path = self.path(key)
        header = self._header(key)
        head = MAGIC + _HEAD.pack(len(header)) + header
        crc = zlib.crc32(payload, zlib.crc32(head))
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        try:
            with open(tmp, "wb", buffering=0) as f:
                f.write(head)
                f.write(memoryview(payload))
                f.write(_CRC.pack(crc))
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_usage(self) -> int:
        try:
            return int((self.root / "usage").read_text())
        except (OSError, ValueError):
            return self._evict(self.max_bytes)[0]  # none yet, or unreadable: count the files

    def _write_usage(self, used: int) -> None:
        tmp = self.root / f".usage.{os.getpid()}.tmp"
        tmp.write_text(str(used))
        os.replace(tmp, self.root / "usage")

    def _evict(self, target: int) -> tuple[int, int]:
        """Under the lock: remove the least recently used block files until the files fit target bytes, and
        the temp files of writers that are gone -> (bytes left, files removed). Temp files of live writers
        count (their bytes are reserved)."""
        blocks, used, removed = [], 0, 0
        for mtime, size, p in self._files():
            if p.suffix == SUFFIX:
                blocks.append((mtime, size, p))
            elif _orphan(p, mtime):
                p.unlink(missing_ok=True)
                continue
            used += size
        for _, size, p in sorted(blocks):
            if used <= target:
                break
            p.unlink(missing_ok=True)
            used -= size
            removed += 1
        self._write_usage(used)
        return used, removed

    def _files(self) -> Iterator[tuple[float, int, Path]]:
        for folder in self.root.iterdir():
            if not folder.is_dir():
                continue
            for entry in os.scandir(folder):
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue  # removed meanwhile
                yield st.st_mtime, st.st_size, Path(entry.path)


def _orphan(path: Path, mtime: float) -> bool:
    """A temp file whose writer is gone: its process (named in it) does not run here, or it is old."""
    if not path.name.endswith(".tmp"):
        return False
    try:
        pid = int(path.name.split(".")[-3])
    except (ValueError, IndexError):
        return time.time() - mtime > _STALE_TEMP_SECONDS
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # another user's live process
    return time.time() - mtime > _STALE_TEMP_SECONDS
