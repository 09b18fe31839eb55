"""The prefix cache's disk tier: full KV blocks written to block files (memory/disk_blocks.py) as they are
committed, read back into the pool for a prompt whose prefix misses the pool but is on disk.

The engine's thread only copies and queues: save() copies a committed block's codes into a staging buffer (the
pool may hand the block out again at once), find() checks which of a prompt's next blocks have a file, and
start_load() hands a LoadJob to the reader. Two threads of the tier's own do the file work: the writer
(batches of staged blocks, within the bound) and the reader (a job's files into the pool blocks reserved for
it, in chain order, stopping at the first that is missing or fails its checks). While the engine serves, both
keep to a few percent of a core (CpuPace), so the steps beside them keep their speed. The engine polls
finished() between steps; a job's request waits meanwhile while the others step. Nothing here blocks the step
loop.
"""

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from memory.disk_blocks import BadBlockFile, BlockFiles, BlockKey, parts_spec
from memory.kv_cache import KVCache

DISK_FORMAT_VERSION = 2  # the block files' identity: bump when what a block's payload means changes
# (2: int4_hadamard rows became Gaussian codebook indices)
STAGING_BYTES = 256 << 20  # blocks copied and waiting for the writer at most; more are not written
READ_RATE_WINDOW_S = 5.0
# the CPU time the tier's threads take while the step loop serves, as a fraction of one core (a step waits for
# every kernel thread: whatever a thread loses to ours, the step loses); idle, they run at full speed
BACKGROUND_CPU_SHARE = 0.02
WRITE_BATCH = 32  # blocks written between two paces

log = logging.getLogger(__name__)


class CpuPace:
    """Keeps a thread's CPU time within `share` of the wall-clock time while busy() says the step loop is
    serving (its kernels' threads then hold every core, and a step waits for whichever thread lost its core
    to ours): pace() after each unit of work sleeps as long as that takes. While the engine idles: no
    pause."""

    def __init__(self, share: float, busy: Callable[[], bool], cpu: Callable[[], float] = time.thread_time,
                 wall: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep):
        """cpu, wall, sleep: the calling thread's CPU clock, a wall clock and a sleep (tests inject them)."""
        self.share, self.busy = share, busy
        self.cpu, self.wall, self.sleep = cpu, wall, sleep
        self.restart()

    def restart(self) -> None:
        self.cpu_from, self.wall_from = self.cpu(), self.wall()

    def pace(self) -> None:
        if not self.busy():
            self.restart()
            return
        ahead = (self.cpu() - self.cpu_from) / self.share - (self.wall() - self.wall_from)
        if ahead > 0:
            self.sleep(ahead)


@dataclass
class LoadJob:
    """Blocks of one request's prefix being read from disk into pool blocks reserved for them."""

    request_id: str
    keys: list[BlockKey]  # in chain order
    block_ids: list[int]  # the pool blocks they go to (held by the job: ref count 1)
    extra: tuple  # the request's prefix-cache extra (the pool's key of the blocks)
    num_loaded: int = 0  # leading blocks read and verified (the rest hold nothing)
    done: threading.Event = field(default_factory=threading.Event)
    started: float = 0.0  # perf_counter when the reader took it up, and when it was done
    ended: float = 0.0


@dataclass(frozen=True)
class DiskStats:
    """The disk tier's counters since the engine started, and its files now."""

    lookups: int  # prompts whose prefix missed the pool at a full block and were looked up on disk
    hits: int  # of those, found at least one block on disk
    misses: int  # found none
    hit_blocks: int  # blocks read back and verified
    missing_blocks: int  # found by a lookup, gone by the time they were read
    rejected_blocks: int  # files failing a check (truncated, corrupted, foreign, stale): removed, not served
    read_bytes: int
    reads_per_s: float  # blocks read per second over the last READ_RATE_WINDOW_S
    written_blocks: int
    written_bytes: int
    dropped_blocks: int  # not written: staging full, or a write failed
    evicted_files: int  # removed by this engine's writes to stay within the bound
    used_bytes: int  # every block file under the folder (all models), as the ledger counts them
    max_bytes: int

    def as_dict(self) -> dict:
        return {f"disk_{k}": v for k, v in self.__dict__.items()}


class DiskTier:
    def __init__(self, directory: str | Path, max_bytes: int, identity: dict, kv_cache: KVCache,
                 adapter_digest: Callable[[str], str], busy: Callable[[], bool] = lambda: False):
        """identity: what decides a block's KV besides its tokens and key (the model's packed-cache key, the
        KV layout); adapter_digest(name): the content digest of a loaded adapter; busy(): whether the step
        loop is serving requests (the tier's threads then keep to BACKGROUND_CPU_SHARE of a core). Raises
        OSError if the folder cannot be used."""
        self._read_pace = CpuPace(BACKGROUND_CPU_SHARE, busy)
        self._write_pace = CpuPace(BACKGROUND_CPU_SHARE, busy)
        self.kv_cache = kv_cache
        self.adapter_digest = adapter_digest
        parts = parts_spec(kv_cache.block_parts(0))
        self.files = BlockFiles(Path(directory).expanduser() / "kv",
                                identity | {"disk_format": DISK_FORMAT_VERSION}, parts, max_bytes)
        self.block_bytes = self.files.payload_bytes
        self.wake: Callable[[], None] = lambda: None  # called (on the reader's thread) when a job is done
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self._reads: collections.deque[tuple[float, int]] = collections.deque()
        self._staged_bytes = 0
        self._writes: queue.SimpleQueue = queue.SimpleQueue()
        self._loads: queue.SimpleQueue = queue.SimpleQueue()
        self._finished: list[LoadJob] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._write_loop, name="numaserve-disk-writer", daemon=True),
                         threading.Thread(target=self._read_loop, name="numaserve-disk-reader", daemon=True)]
        for t in self._threads:
            t.start()

    def key(self, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
            extra: tuple) -> BlockKey:
        """A block's key on disk: its place in the chain and what else keys it, the adapter by its content."""
        adapter, salt = extra
        digest = None if adapter is None else self.adapter_digest(adapter)
        return BlockKey(block_hash, parent_hash, tuple(token_ids), repr((adapter, digest, salt)))

    # ---- the engine's thread -------------------------------------------------------------------------------

    def save(self, key: BlockKey, block_id: int) -> None:
        """Queue a just-committed block for writing (a copy of it: the block itself may be reused at once),
        unless its file is there (it is then marked used)."""
        if self.files.touch(key):
            return
        with self._lock:
            if self._staged_bytes + self.block_bytes > STAGING_BYTES:
                self._counts["dropped_blocks"] += 1
                return
            self._staged_bytes += self.block_bytes
        payload = np.empty(self.block_bytes, np.uint8)
        offset = 0
        for part in self.kv_cache.block_parts(block_id):
            payload[offset:offset + part.nbytes] = part.reshape(-1).view(np.uint8)
            offset += part.nbytes
        self._writes.put((key, payload))

    def find(self, keys: Sequence[BlockKey]) -> int:
        """How many of keys (a prompt's next blocks, in chain order) have a file -> the leading count."""
        n = 0
        while n < len(keys) and self.files.exists(keys[n]):
            n += 1
        with self._lock:
            self._counts["lookups"] += 1
            self._counts["hits"] += n > 0
        return n

    def start_load(self, job: LoadJob) -> None:
        self._loads.put(job)

    def finished(self) -> list[LoadJob]:
        """The jobs done since the last call."""
        with self._lock:
            done, self._finished = self._finished, []
        return done

    def stats(self) -> DiskStats:
        now = time.monotonic()
        with self._lock:
            while self._reads and self._reads[0][0] < now - READ_RATE_WINDOW_S:
                self._reads.popleft()
            rate = sum(n for _, n in self._reads) / READ_RATE_WINDOW_S
            c = dict(self._counts)
        try:
            used_bytes = self.files.usage()
        except OSError:
            used_bytes = -1
        lookups, hits = c.get("lookups", 0), c.get("hits", 0)
        names = ("hit_blocks", "missing_blocks", "rejected_blocks", "read_bytes")
        return DiskStats(lookups, hits, lookups - hits, *(c.get(n, 0) for n in names), rate,
                         c.get("written_blocks", 0), c.get("written_bytes", 0), c.get("dropped_blocks", 0),
                         c.get("evicted_files", 0),
                         used_bytes, self.files.max_bytes)

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every block staged so far is written (or dropped) -> whether that happened in time."""
        done = threading.Event()
        self._writes.put(done)
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is staged (up to timeout_s), then stop both threads. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writes.put(None)
        self._loads.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0.0))

    # ---- the tier's threads --------------------------------------------------------------------------------

    def _write_loop(self) -> None:
        try:
            evicted = self.files.sweep()  # a start recounts the files: writers killed before leave no trace
        except OSError as e:
            log.warning("the prefix cache's disk tier could not sweep %s: %s", self.files.root, e)
        else:
            self._count("evicted_files", evicted)
        while True:
            items = [self._writes.get()]
            while True:  # everything staged meanwhile, in one pass over the lock
                try:
                    items.append(self._writes.get_nowait())
                except queue.Empty:
                    break
            batch = [item for item in items if isinstance(item, tuple)]
            self._write_pace.restart()  # (the time it waited for work is no credit)
            for start in range(0, len(batch), WRITE_BATCH):
                self._write(batch[start:start + WRITE_BATCH])
                self._write_pace.pace()
            for item in items:
                if isinstance(item, threading.Event):  # flush(): everything staged before it is written
                    item.set()
            if None in items:
                return

    def _write(self, batch: list[tuple[BlockKey, np.ndarray]]) -> None:
        try:
            written, num_bytes, evicted = self.files.write(batch)
        except OSError as e:
            log.warning("the prefix cache's disk tier could not write %d blocks: %s", len(batch), e)
            written, num_bytes, evicted = 0, 0, 0
            self._count("dropped_blocks", len(batch))
        with self._lock:
            self._staged_bytes -= len(batch) * self.block_bytes
            self._counts["written_blocks"] += written
            self._counts["written_bytes"] += num_bytes
            self._counts["evicted_files"] += evicted

    def _read_loop(self) -> None:
        while (job := self._loads.get()) is not None:
            job.started = time.perf_counter()
            self._read_pace.restart()
            try:
                self._read(job)
            finally:
                job.ended = time.perf_counter()
                with self._lock:
                    self._finished.append(job)
                job.done.set()
                self.wake()

    def _read(self, job: LoadJob) -> None:
        for key, block_id in zip(job.keys, job.block_ids):
            try:
                n = self.files.read_into(key, self.kv_cache.block_parts(block_id))
            except FileNotFoundError:
                self._count("missing_blocks")
                return
            except BadBlockFile as e:
                log.warning("prefix cache disk tier: %s; ignored and removed", e)
                self._count("rejected_blocks")
                return
            except OSError as e:
                log.warning("prefix cache disk tier: cannot read %s: %s", self.files.path(key), e)
                self._count("missing_blocks")
                return
            job.num_loaded += 1
            self._read_pace.pace()
            with self._lock:
                self._counts["hit_blocks"] += 1
                self._counts["read_bytes"] += n
                self._reads.append((time.monotonic(), 1))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n
