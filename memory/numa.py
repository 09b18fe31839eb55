"""NUMA topology, pinning and memory binding of one worker process.

The topology comes from /sys/devices/system/node (cut to the cores this process may use), or from a
ClusterConfig that declares nodes to simulate a multi-socket box. A worker pins every thread it has to
its node's cores *before* numba starts its thread pool: threads inherit the affinity (and the memory
policy) of the thread that creates them, so the pool, the step loop and anything started later stay on
the node. Where libnuma is present, memory is also bound to the physical node(s) holding those cores.
"""

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import psutil

NODE_ROOT = Path("/sys/devices/system/node")
PAGE_BYTES = 4096


@dataclass(frozen=True)
class NumaNode:
    node_id: int
    cpu_ids: tuple[int, ...]


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpu_ids: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpu_ids += range(int(lo), int(hi or lo) + 1)
    return cpu_ids


def allowed_cpu_ids() -> list[int]:
    return sorted(psutil.Process().cpu_affinity())


def read_topology(root: Path = NODE_ROOT, allowed: list[int] | None = None) -> list[NumaNode]:
    """NUMA nodes with the cores of theirs this process may run on; one node 0 where /sys has none."""
    allowed_set = set(allowed_cpu_ids() if allowed is None else allowed)
    nodes = []
    for node_dir in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        cpu_ids = [c for c in parse_cpu_list((node_dir / "cpulist").read_text()) if c in allowed_set]
        if cpu_ids:  # memory-only nodes and nodes outside our cgroup serve no worker
            nodes.append(NumaNode(int(node_dir.name[4:]), tuple(cpu_ids)))
    return nodes or [NumaNode(0, tuple(sorted(allowed_set)))]


def node_memory_bytes(node_id: int, root: Path = NODE_ROOT) -> int | None:
    """A node's memory (MemTotal of /sys/devices/system/node/node<id>/meminfo); None where /sys has no such
    node."""
    try:
        text = (root / f"node{node_id}" / "meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split()  # "Node 0 MemTotal: 22505248 kB"
        if len(fields) >= 4 and fields[2] == "MemTotal:":
            return int(fields[3]) * 1024
    return None


def physical_node_ids(cpu_ids: tuple[int, ...], topology: list[NumaNode]) -> list[int]:
    """The real nodes holding these cores: a simulated node's memory lives on them."""
    wanted = set(cpu_ids)
    return [n.node_id for n in topology if wanted & set(n.cpu_ids)]


def pin_process(cpu_ids: tuple[int, ...]) -> int:
    """Pin every thread of this process to cpu_ids; returns how many threads were pinned."""
    num_pinned = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpu_ids)
            num_pinned += 1
        except ProcessLookupError:
            pass  # the thread exited meanwhile
    return num_pinned


def thread_cpu_ids() -> tuple[int, ...]:
    """Union of the affinities of every thread of this process, as the kernel reports them now."""
    cpu_ids: set[int] = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            cpu_ids |= os.sched_getaffinity(int(tid))
        except ProcessLookupError:
            pass
    return tuple(sorted(cpu_ids))


MPOL_BIND = 2  # <linux/mempolicy.h>
MPOL_MODE_FLAGS = (1 << 15) | (1 << 14) | (1 << 13)  # MPOL_F_STATIC_NODES, _RELATIVE_NODES, _NUMA_BALANCING
MPOL_MF_MOVE = 1 << 1  # mbind: move the range's pages that are elsewhere and mapped by this process alone
MPOL_F_ADDR = 1 << 1  # get_mempolicy: the policy of the mapping at an address, not the thread's
_WORD_BITS = 8 * ctypes.sizeof(ctypes.c_ulong)
_MASK_BITS = 16 * _WORD_BITS  # node mask bits passed to the kernel: whole words, more than any node id
NodeMask = ctypes.c_ulong * (_MASK_BITS // _WORD_BITS)


@cache
def _libnuma() -> ctypes.CDLL | str:
    """libnuma, or why not (the text a binding reports). Cached: find_library runs ldconfig."""
    path = ctypes.util.find_library("numa")
    if path is None:
        return "libnuma not found"
    libnuma = ctypes.CDLL(path, use_errno=True)
    if libnuma.numa_available() < 0:
        return "the kernel has no NUMA support"
    # <numaif.h>: long mbind(void *, unsigned long, int, const unsigned long *, unsigned long, unsigned);
    # long get_mempolicy(int *, unsigned long *, unsigned long, void *, unsigned)
    libnuma.mbind.restype = libnuma.get_mempolicy.restype = ctypes.c_long
    libnuma.mbind.argtypes = [ctypes.c_void_p, ctypes.c_ulong, ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong,
                              ctypes.c_uint]
    libnuma.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong,
                                      ctypes.c_void_p, ctypes.c_uint]
    return libnuma


def _bound(node_ids: list[int]) -> str:
    """What a binding to node_ids reports."""
    return "bind:" + ",".join(map(str, node_ids))


def memory_policy(address: int | None = None) -> tuple[int, list[int]] | None:
    """(mode, node ids) of this thread's memory policy, or of the mapping holding address (mode 0: the
    default, first touch; its flags masked off); None without libnuma. Raises OSError where the kernel
    refuses the call (a seccomp profile that denies it)."""
    libnuma = _libnuma()
    if isinstance(libnuma, str):
        return None
    mode, mask = ctypes.c_int(0), NodeMask()
    flags = 0 if address is None else MPOL_F_ADDR
    if libnuma.get_mempolicy(ctypes.byref(mode), mask, _MASK_BITS, address, flags) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy: {os.strerror(err)}")
    node_ids = [n for n in range(_MASK_BITS) if mask[n // _WORD_BITS] >> (n % _WORD_BITS) & 1]
    return mode.value & ~MPOL_MODE_FLAGS, node_ids


def bind_range_as_thread(address: int, nbytes: int) -> str:
    """Bind the pages [address, address + nbytes) (page-aligned: a mapping's start) to the nodes this thread's
    memory is bound to (bind_memory), moving there those of them that sit on another node as far as the kernel
    can (MPOL_MF_MOVE: pages another process maps too stay where they are, silently). What it did, for the
    decision log; a thread with no binding (or no libnuma, or a kernel that refuses the calls) leaves the
    range to first touch."""
    libnuma = _libnuma()
    if isinstance(libnuma, str):
        return f"first-touch ({libnuma})"
    try:
        policy = memory_policy()
    except OSError as e:
        return f"first-touch ({e.strerror})"
    if policy is None or policy[0] != MPOL_BIND:
        return "first-touch (this thread's memory is not bound)"
    _, node_ids = policy
    mask = NodeMask()
    for n in node_ids:
        mask[n // _WORD_BITS] |= 1 << (n % _WORD_BITS)
    if libnuma.mbind(address, nbytes, MPOL_BIND, mask, _MASK_BITS, MPOL_MF_MOVE) != 0:
        err = ctypes.get_errno()
        return f"first-touch (mbind to {','.join(map(str, node_ids))}: {os.strerror(err)})"
    return _bound(node_ids)


def bind_memory(node_ids: list[int]) -> str:
    """Bind this thread's (and its future threads') allocations to node_ids with libnuma, if present."""
    if not node_ids:
        return "first-touch (no physical node holds these cores)"
    libnuma = _libnuma()
    if isinstance(libnuma, str):
        return f"first-touch ({libnuma})"
    libnuma.numa_parse_nodestring.restype = ctypes.c_void_p
    libnuma.numa_parse_nodestring.argtypes = [ctypes.c_char_p]
    libnuma.numa_set_membind.argtypes = [ctypes.c_void_p]
    libnuma.numa_bitmask_free.argtypes = [ctypes.c_void_p]
    nodes = ",".join(map(str, node_ids))
    mask = libnuma.numa_parse_nodestring(nodes.encode())
    if not mask:
        return f"first-touch (libnuma rejected nodes {nodes})"
    libnuma.numa_set_membind(mask)
    libnuma.numa_bitmask_free(mask)
    return _bound(node_ids)


def first_touch(*arrays: np.ndarray) -> None:
    """Write every page so the kernel places it now, on the calling (pinned) thread's node.

    np.zeros gets large arrays from calloc/mmap, whose pages are only placed when first written.
    """
    for a in arrays:
        flat = a.reshape(-1).view(np.uint8)
        flat[::PAGE_BYTES] = 0
