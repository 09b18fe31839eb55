"""NUMA topology parsing, pinning of every thread, memory binding (a thread's, and a mapping's with mbind),
first touch (no Ray)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from memory import numa


def fake_sys(tmp_path, nodes: dict[int, str]):
    for node_id, cpulist in nodes.items():
        (tmp_path / f"node{node_id}").mkdir()
        (tmp_path / f"node{node_id}" / "cpulist").write_text(cpulist + "\n")
    (tmp_path / "possible").write_text("0-1\n")  # not a node directory: ignored
    return tmp_path


@pytest.mark.parametrize("text, cpu_ids", [("0", [0]), ("0-3", [0, 1, 2, 3]),
                                           ("0-1,8,10-11", [0, 1, 8, 10, 11]), ("", [])])
def test_parse_cpu_list_reads_the_kernel_format(text, cpu_ids):
    assert numa.parse_cpu_list(text) == cpu_ids


def test_topology_of_a_two_socket_box_is_cut_to_the_allowed_cores(tmp_path):
    root = fake_sys(tmp_path, {0: "0-3,8-11", 1: "4-7,12-15", 2: ""})  # node 2: memory only
    topology = numa.read_topology(root, allowed=list(range(16)))
    assert topology == [numa.NumaNode(0, (0, 1, 2, 3, 8, 9, 10, 11)),
                        numa.NumaNode(1, (4, 5, 6, 7, 12, 13, 14, 15))]
    assert numa.read_topology(root, allowed=[2, 3, 12]) == [numa.NumaNode(0, (2, 3)), numa.NumaNode(1, (12,))]
    assert numa.physical_node_ids((3, 4), topology) == [0, 1]


def test_a_machine_without_numa_in_sys_is_one_node_of_its_allowed_cores(tmp_path):
    assert numa.read_topology(tmp_path / "absent", allowed=[0, 1]) == [numa.NumaNode(0, (0, 1))]


def test_this_machines_topology_covers_exactly_the_cores_we_may_use():
    topology = numa.read_topology()
    assert sorted(c for n in topology for c in n.cpu_ids) == numa.allowed_cpu_ids()


def test_pinning_reaches_every_thread_and_threads_started_later_inherit_it():
    # in a fresh process: pinning is irreversible for the test process's own threads
    cpu = numa.allowed_cpu_ids()[-1]
    code = textwrap.dedent(f"""
        import os, threading
        from memory import numa
        stop = threading.Event()
        early = threading.Thread(target=stop.wait); early.start()
        assert numa.pin_process(({cpu},)) >= 2
        late = threading.Thread(target=stop.wait); late.start()
        print(numa.thread_cpu_ids(), len(os.listdir("/proc/self/task")))
        stop.set()
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout.split()
    assert out[0] == f"({cpu},)" and int(out[1]) >= 3


def test_memory_binding_reports_what_it_did():
    policy = numa.bind_memory([])
    assert policy.startswith("first-touch")
    code = "from memory import numa; print(numa.bind_memory([0]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout.strip()
    assert out == "bind:0" or out.startswith("first-touch (")


def test_first_touch_keeps_the_values():
    a = np.arange(10_000, dtype=np.float32).reshape(100, 100)
    b = np.zeros((3, 5000), np.int8)
    numa.first_touch(a[:0], b)
    assert b.sum() == 0
    numa.first_touch(np.zeros(1 << 20, np.uint16))


def test_a_range_takes_the_threads_binding_and_reports_it(tmp_path):
    if (numa.memory_policy() or (0,))[0] == numa.MPOL_BIND:
        pytest.skip("this process's memory is bound already (numactl --membind?): no unbound thread to test")
    blob = tmp_path / "blob"
    blob.write_bytes(bytes(range(256)) * 4096)  # 1 MiB: 256 pages
    code = textwrap.dedent(f"""
        import mmap
        import numpy as np
        from memory import numa
        with open({str(blob)!r}, "rb") as f:
            m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        buf = np.frombuffer(m, np.uint8)
        address = buf.ctypes.data
        print(numa.bind_range_as_thread(address, len(m)))
        print(numa.bind_memory([0]))
        print(numa.bind_range_as_thread(address, len(m)))
        print(numa.memory_policy(address), numa.memory_policy(address + len(m) - 1), numa.memory_policy())
        assert buf[::4096].tolist() == [0] * 256 and int(buf.sum()) == 255 * 128 * 4096  # the bytes unchanged
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__)))).stdout.splitlines()
    assert out[0] in ("first-touch (this thread's memory is not bound)", "first-touch (libnuma not found)",
                      "first-touch (the kernel has no NUMA support)")
    if out[1] != "bind:0":
        assert out[2].startswith("first-touch (")
        return
    bind = f"({numa.MPOL_BIND}, [0])"
    assert out[2] == "bind:0" and out[3] == f"{bind} {bind} {bind}"
