"""The shared-memory segment of one tensor-parallel group: how its ranks (one process each, on one machine)
sum partial results, gather logits and pass rank 0's step plan, with no network and no Ray in the step.

Layout of the segment (a file under /dev/shm, unlinked once every rank has it mapped, so a killed group
leaves nothing behind):

    control: int64 [num_ranks + 1, 8]     one cache line a row, so ranks never write the same line
        [r, 0] the last collective rank r wrote   [r, 1] rank r's pid   [r, 2] the last plan rank r read
        [r, 3 + k % 2] the width of rank r's part in gather k (two, as the slots)
        [R, 0] the last plan rank 0 wrote          [R, 1] its bytes      [R, 2] 1 once a rank gave up
    slots:   float32 [2, num_ranks, slot_elems]   collective k uses slots[k % 2]
    plan:    uint8 [plan_bytes]

A rank writes its slot, then its sequence number (x86 keeps stores in order); a collective is complete for a
rank once every rank's number reached its own. Two sets of slots suffice: to write collective k + 2 a rank
must have seen every rank reach k + 1, which each does only after it finished reading collective k. Every rank
sums the slots in rank order (kernels/reduce.py), so all ranks hold the same bits, whatever the timing.
"""

import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil

from cluster_configs.errors import RankLost
from kernels.reduce import sum_slots

SHM_ROOT = Path("/dev/shm")
LINE = 8  # int64 words in a cache line
SPIN_CHECKS = 2000  # checks of a wait before it starts yielding the core (a peer usually answers within them)
LIVENESS_EVERY_S = 0.05  # how often a wait checks that its peers' processes still run
SLEEP_AFTER_S = 0.002  # waiting longer than this, a rank sleeps between checks (an idle follower)
SLEEP_S = 0.0005


@dataclass(frozen=True)
class GroupLayout:
    """What a rank needs to map a group's segment (sent to each follower when it starts)."""
    path: str
    num_ranks: int
    slot_elems: int  # float32 values a rank's slot holds: the largest tensor one collective moves
    plan_bytes: int
    timeout_s: float = 300.0  # a peer alive but silent this long fails the wait (a hang, not a slow step)

    @staticmethod
    def new(num_ranks: int, slot_elems: int, plan_bytes: int = 1 << 20, **kw) -> "GroupLayout":
        # named by the creating process, so a test can tell its own segments from another process's
        return GroupLayout(str(SHM_ROOT / f"numaserve-tp-{os.getpid()}-{uuid.uuid4().hex}"), num_ranks,
                           slot_elems, plan_bytes, **kw)

    @property
    def control_words(self) -> int:
        return (self.num_ranks + 1) * LINE

    @property
    def total_bytes(self) -> int:
        return 8 * self.control_words + 4 * 2 * self.num_ranks * self.slot_elems + self.plan_bytes


class SharedGroup:
    """One rank's view of the segment. Rank 0 creates it (`create`), followers map it (`attach`)."""

    def __init__(self, layout: GroupLayout, rank: int, fd: int):
        self.layout, self.rank = layout, rank
        self._mmap = mmap.mmap(fd, layout.total_bytes)
        os.close(fd)
        buf, r = memoryview(self._mmap), layout.num_ranks
        words, slot_floats = layout.control_words, 2 * r * layout.slot_elems
        self.control = np.frombuffer(buf, np.int64, words).reshape(r + 1, LINE)
        self.slots = np.frombuffer(buf, np.float32, slot_floats, 8 * words).reshape(2, r, layout.slot_elems)
        self.plan = np.frombuffer(buf, np.uint8, layout.plan_bytes, 8 * words + 4 * slot_floats)
        self.num_collectives = 0
        self.num_plans = 0
        self.wait_seconds = 0.0  # in collectives, waiting for a peer to publish its part (it ran slower)
        self._part, self._part_seq = None, 0  # next_part's slot, and the collective it was taken for
        self._own = (self.slots[0, rank], self.slots[1, rank])  # this rank's slot of even, odd collectives
        self._peers: dict[int, psutil.Process] = {}
        self._others = [r for r in range(layout.num_ranks) if r != rank]
        self.control[rank, 1] = os.getpid()

    @classmethod
    def create(cls, layout: GroupLayout) -> "SharedGroup":
        """Rank 0 makes the segment, sized before it takes its name (a follower never maps a short file)."""
        sizing = layout.path + ".new"
        fd = os.open(sizing, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, layout.total_bytes)
            os.rename(sizing, layout.path)
        except OSError:
            os.close(fd)
            os.unlink(sizing)
            raise
        return cls(layout, 0, fd)

    @classmethod
    def attach(cls, layout: GroupLayout, rank: int) -> "SharedGroup":
        """A follower maps the segment, waiting (up to the layout's timeout) for rank 0 to create it."""
        if not 0 < rank < layout.num_ranks:
            raise ValueError(f"a follower's rank is 1..{layout.num_ranks - 1}, not {rank}")
        deadline = time.monotonic() + layout.timeout_s
        while True:
            try:
                return cls(layout, rank, os.open(layout.path, os.O_RDWR))
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise RankLost(f"rank {rank}: the group's segment did not appear within "
                                   f"{layout.timeout_s:.0f} s (rank 0 did not start); "
                                   "restart the group") from None
                time.sleep(0.01)

    # ---- set-up and tear-down ------------------------------------------------------------------------

    def wait_attached(self, alive=None) -> None:
        """Rank 0: waits until every follower has mapped the segment, then removes its name (from then on
        it lives exactly as long as some rank maps it). alive() -> False gives up (a follower that died
        before it attached has no pid here to watch)."""
        try:
            self._wait(lambda: bool(np.all(self.control[:self.layout.num_ranks, 1] != 0)), "attach",
                       alive=alive)
        finally:
            self.unlink()

    def unlink(self) -> None:
        try:
            os.unlink(self.layout.path)
        except FileNotFoundError:
            pass

    def abort(self) -> None:
        """Tells every rank's waits to fail now (this rank gives up on the group)."""
        self.control[self.layout.num_ranks, 2] = 1

    def close(self) -> None:
        for name in ("control", "slots", "plan", "_own", "_part"):
            setattr(self, name, None)
        try:
            self._mmap.close()
        except BufferError:
            pass  # a view of it is still held somewhere: the mapping goes with the last one

    # ---- collectives ---------------------------------------------------------------------------------

    def next_part(self, rows: int, cols: int) -> np.ndarray:
        """This rank's slot of the next collective as float32 [rows, cols]: a partial result written here is
        published without a copy (all_reduce(part, out=...)). The next collective must be its all_reduce."""
        if rows * cols > self.layout.slot_elems:
            raise ValueError(f"a collective of {rows * cols} values exceeds the group's slots of "
                             f"{self.layout.slot_elems}")
        self._part_seq = self.num_collectives + 1
        self._part = self._own[self._part_seq % 2][:rows * cols].reshape(rows, cols)
        return self._part

    def all_reduce(self, x: np.ndarray, num_tasks: int = 1, out: np.ndarray | None = None) -> None:
        """x (float32, C-contiguous) := the sum of every rank's x, added in rank order. With out: x is
        next_part's slot, written in place, which the other ranks read: the sum goes to out instead."""
        in_slot = out is not None
        if in_slot and (x is not self._part or self._part_seq != self.num_collectives + 1):
            raise ValueError("all_reduce(x, out=...) sums a partial written into next_part's slot, taken "
                             "right before it; this x is not that slot")
        if not x.flags.c_contiguous:
            raise ValueError("all_reduce sums in place: x must be C-contiguous")
        flat = x.reshape(x.size)
        target = flat if out is None else out.reshape(out.size)
        sum_slots(self._publish(flat, in_slot=in_slot), x.size, target, num_tasks)

    def gather(self, part: np.ndarray, out: np.ndarray | None) -> None:
        """Rank 0: out[:, offsets] := every rank's part [rows, width_r] side by side in rank order (the
        vocabulary shards of the logits). Followers pass out=None and only contribute."""
        rows, width = part.shape
        slots = self._publish(np.ascontiguousarray(part).reshape(part.size), width)
        if out is not None:
            col = 0
            for r in range(self.layout.num_ranks):
                width = int(self.control[r, 3 + self.num_collectives % 2])
                out[:, col:col + width] = slots[r, :rows * width].reshape(rows, width)
                col += width
            if col != out.shape[1]:
                raise ValueError(f"the ranks' parts are {col} wide together, out is {out.shape[1]}")

    def _publish(self, flat: np.ndarray, width: int = 0, in_slot: bool = False) -> np.ndarray:
        """Writes this rank's part (in_slot: already there), waits for every rank's; -> the slots of this
        collective."""
        if flat.size > self.layout.slot_elems:
            raise ValueError(f"a collective of {flat.size} values exceeds the group's slots of "
                             f"{self.layout.slot_elems}")
        seq = self.num_collectives + 1
        slots = self.slots[seq % 2]
        if not in_slot:
            slots[self.rank, :flat.size] = flat
        self.control[self.rank, 3 + seq % 2] = width
        self.control[self.rank, 0] = seq
        control = self.control
        for peer in self._others:  # a word at a time: ~100 ns a check, where np.all costs microseconds
            if control[peer, 0] < seq:
                start = time.perf_counter()
                self._wait(lambda: control[peer, 0] >= seq, f"collective {seq}")  # noqa: B023 - called now
                self.wait_seconds += time.perf_counter() - start
        self.num_collectives = seq
        return slots

    # ---- rank 0's plan -------------------------------------------------------------------------------

    def send_plan(self, payload: bytes) -> None:
        """Rank 0: publishes the next step's plan once every follower has read the last one."""
        if len(payload) > self.layout.plan_bytes:
            raise ValueError(f"a step plan of {len(payload)} bytes exceeds the group's "
                             f"{self.layout.plan_bytes}")
        last, r = self.num_plans, self.layout.num_ranks
        acks = self.control[1:r, 2]
        self._wait(lambda: bool(np.all(acks >= last)), f"plan {last} read")
        self.plan[:len(payload)] = np.frombuffer(payload, np.uint8)
        self.control[r, 1] = len(payload)
        self.control[r, 0] = last + 1
        self.num_plans = last + 1

    def receive_plan(self) -> bytes:
        """A follower: waits for the next plan (sleeping once it has waited a while: an idle group)."""
        r, want = self.layout.num_ranks, self.num_plans + 1
        self._wait(lambda: self.control[r, 0] >= want, f"plan {want}", deadline=False)
        payload = self.plan[:int(self.control[r, 1])].tobytes()
        self.num_plans = want
        self.control[self.rank, 2] = want
        return payload

    # ---- waiting -------------------------------------------------------------------------------------

    def _wait(self, done, what: str, alive=None, deadline: bool = True) -> None:
        """Spins until done(), then yields the core, then sleeps; fails with RankLost when a peer's process
        is gone, a rank aborted, or (deadline) a peer stays silent for the layout's timeout."""
        for _ in range(SPIN_CHECKS):
            if done():
                return
        start = time.monotonic()
        next_check = start
        while not done():
            now = time.monotonic()
            if now >= next_check:
                self._check_peers(what, alive)
                if deadline and now - start > self.layout.timeout_s:
                    self.abort()
                    raise RankLost(f"rank {self.rank}: no answer from the group within "
                                   f"{self.layout.timeout_s:.0f} s at {what}; restart the group")
                next_check = now + LIVENESS_EVERY_S
            if now - start > SLEEP_AFTER_S:
                time.sleep(SLEEP_S)
            else:
                os.sched_yield()

    def _check_peers(self, what: str, alive) -> None:
        r = self.layout.num_ranks
        if self.control[r, 2]:
            raise RankLost(f"rank {self.rank}: another rank gave up on the group at {what}; "
                           "restart the group")
        if alive is not None and not alive():
            self.abort()
            raise RankLost(f"rank {self.rank}: a rank's process ended before it joined the group")
        for peer in range(r):
            pid = int(self.control[peer, 1])
            if peer == self.rank or pid == 0:
                continue
            if not self._running(peer, pid):
                self.abort()
                raise RankLost(f"rank {self.rank}: rank {peer} (pid {pid}) is gone at {what}; "
                               "restart the group")

    def _running(self, peer: int, pid: int) -> bool:
        try:
            proc = self._peers.get(peer)
            if proc is None or proc.pid != pid:
                proc = self._peers[peer] = psutil.Process(pid)
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
