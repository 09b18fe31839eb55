"""The tensor-parallel group's shared segment between real processes: all-reduces equal to the rank-order sum
on every rank (the same bits on all, partials copied in or written into the slot), gathers, rank 0's plans
in order, and a dead rank failing its peers' waits with RankLost instead of a hang. No Ray."""

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from cluster_configs.errors import RankLost
from kernels.reduce import PARALLEL_ELEMS, sum_slots
from memory.shared_group import GroupLayout, SharedGroup

SPAWN = multiprocessing.get_context("spawn")  # a fresh interpreter, as a real rank (no forked numba threads)
NUM_COLLECTIVES = 120


def part(seed: int, k: int, rank: int) -> np.ndarray:
    """Rank `rank`'s input to collective k: sizes vary, so the slots' stale tails must never leak in."""
    rng = np.random.default_rng([seed, k])
    rows = int(rng.integers(1, 9))
    cols = int(rng.choice([7, 64, 4096]))
    return np.random.default_rng([seed, k, rank]).standard_normal((rows, cols)).astype(np.float32)


def rank_order_sum(seed: int, k: int, num_ranks: int) -> np.ndarray:
    total = part(seed, k, 0)
    for r in range(1, num_ranks):
        total = total + part(seed, k, r)  # float32 adds in rank order: the bits every rank must get
    return total


def run_rank(layout: GroupLayout, rank: int, seed: int, results) -> None:
    """Collectives and plans in a fixed script; sends back a digest of what this rank saw."""
    group = SharedGroup.create(layout) if rank == 0 else SharedGroup.attach(layout, rank)
    try:
        if rank == 0:
            group.wait_attached()
        sums, plans = [], []
        for k in range(NUM_COLLECTIVES):
            if k % 10 == 0:  # a plan now and then, between the collectives, as a step's
                if rank == 0:
                    group.send_plan(f"step {k}".encode() * (k + 1))
                else:
                    plans.append(group.receive_plan().decode())
            x = part(seed, k, rank)
            if (k + rank) % 3:
                group.all_reduce(x)
            else:  # written into its slot, as a projection does (no copy), the sum into another array
                in_slot = group.next_part(*x.shape)
                in_slot[:] = x
                group.all_reduce(in_slot, out=x)
            sums.append(x.tobytes())
        widths = [3 + r for r in range(layout.num_ranks)]
        mine = np.full((5, widths[rank]), rank, np.float32)
        out = np.empty((5, sum(widths)), np.float32) if rank == 0 else None
        group.gather(mine, out)
        results.put((rank, sums, plans, None if out is None else out.tolist()))
    except Exception as exc:  # noqa: BLE001 - the test reads it
        results.put((rank, repr(exc), None, None))
    finally:
        group.close()


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_every_rank_gets_the_rank_order_sum_bit_for_bit_the_gather_and_every_plan(num_ranks):
    layout = GroupLayout.new(num_ranks, slot_elems=8 * 4096, plan_bytes=4096)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=run_rank, args=(layout, r, 7, results)) for r in range(num_ranks)]
    for p in procs:
        p.start()
    got = {rank: rest for rank, *rest in (results.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(60)
    assert not Path(layout.path).exists()  # removed once every rank mapped it
    for rank, (sums, plans, _) in got.items():
        assert isinstance(sums, list), f"rank {rank} failed: {sums}"
        for k, raw in enumerate(sums):
            assert raw == rank_order_sum(7, k, num_ranks).tobytes(), f"rank {rank}, collective {k}"
        if rank:
            assert plans == [f"step {k}" * (k + 1) for k in range(0, NUM_COLLECTIVES, 10)]
    gathered = np.array(got[0][2])
    assert gathered.tolist() == np.concatenate(
        [np.full((5, 3 + r), r, np.float32) for r in range(num_ranks)], axis=1).tolist()


def follower_then_exit(layout: GroupLayout, how: str) -> None:
    group = SharedGroup.attach(layout, 1)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # dies mapped, mid-group: no cleanup of any kind
    group.all_reduce(np.ones(4, np.float32))
    group.receive_plan()  # waits for a plan rank 0 never sends: rank 0 is killed by the test


def test_a_killed_follower_fails_rank_0s_collective_with_rank_lost_not_a_hang():
    layout = GroupLayout.new(2, slot_elems=64, plan_bytes=64)
    group = SharedGroup.create(layout)
    proc = SPAWN.Process(target=follower_then_exit, args=(layout, "kill"))
    proc.start()
    try:
        group.wait_attached(alive=proc.is_alive)
        start = time.monotonic()
        with pytest.raises(RankLost, match="rank 1 .* is gone"):
            group.all_reduce(np.ones(4, np.float32))
        assert time.monotonic() - start < 30  # liveness is polled every 50 ms; generous for a loaded machine
    finally:
        proc.join(10)
        group.close()
    assert not Path(layout.path).exists()


def test_a_follower_that_dies_before_attaching_fails_the_wait_and_leaves_no_segment():
    layout = GroupLayout.new(2, slot_elems=64, plan_bytes=64)
    group = SharedGroup.create(layout)
    with pytest.raises(RankLost, match="ended before it joined"):
        group.wait_attached(alive=lambda: False)
    group.close()
    assert not Path(layout.path).exists()


def rank_0_then_killed(layout: GroupLayout, ready) -> None:
    group = SharedGroup.create(layout)
    group.wait_attached()
    group.all_reduce(np.ones(4, np.float32))
    ready.set()
    time.sleep(600)  # killed by the test while its follower waits for a plan


def test_a_killed_rank_0_fails_its_followers_wait_for_a_plan():
    layout = GroupLayout.new(2, slot_elems=64, plan_bytes=64)
    ready = SPAWN.Event()
    proc = SPAWN.Process(target=rank_0_then_killed, args=(layout, ready))
    proc.start()
    group = SharedGroup.attach(layout, 1)  # waits for rank 0 to create the segment
    try:
        x = np.ones(4, np.float32)
        group.all_reduce(x)
        assert x.tolist() == [2.0] * 4
        assert ready.wait(60)
        proc.kill()
        with pytest.raises(RankLost, match="rank 0 .* is gone"):
            group.receive_plan()
    finally:
        proc.join(10)
        group.close()


def test_an_aborting_rank_fails_the_others_waits_and_oversized_inputs_are_refused():
    layout = GroupLayout.new(2, slot_elems=8, plan_bytes=8)
    group = SharedGroup.create(layout)
    try:
        with pytest.raises(ValueError, match="exceeds the group's slots of 8"):
            group.all_reduce(np.ones(9, np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            group.all_reduce(np.ones((4, 4), np.float32)[:, :2])
        with pytest.raises(ValueError, match="exceeds the group's 8"):
            group.send_plan(b"123456789")
        group.next_part(1, 4)
        with pytest.raises(ValueError, match="this x is not that slot"):  # a sum into out reads the slot
            group.all_reduce(np.ones(4, np.float32), out=np.empty(4, np.float32))
        group.abort()
        with pytest.raises(RankLost, match="gave up"):
            group.all_reduce(np.ones(4, np.float32))  # rank 1 never came: the abort ends the wait
    finally:
        group.unlink()
        group.close()


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_the_threaded_sum_has_the_serial_sums_bits_in_rank_order(num_ranks):
    n = PARALLEL_ELEMS + 1001
    slots = np.random.default_rng(num_ranks).standard_normal((num_ranks, n + 5)).astype(np.float32)
    expect = slots[0, :n].copy()
    for r in range(1, num_ranks):
        expect += slots[r, :n]
    for num_tasks in (1, 2, 3):
        out = np.full(n + 5, np.nan, np.float32)
        sum_slots(slots, n, out, num_tasks)
        assert out[:n].tobytes() == expect.tobytes()
        assert np.isnan(out[n:]).all()


def test_a_partial_whose_slot_an_earlier_collective_took_is_refused():
    """next_part's slot belongs to the next collective: used after another one ran, the other ranks could
    still be reading it."""
    group = SharedGroup.create(GroupLayout.new(1, slot_elems=8, plan_bytes=8))
    try:
        group.wait_attached()
        stale = group.next_part(1, 4)
        stale[:] = 1
        group.all_reduce(np.ones(4, np.float32))
        with pytest.raises(ValueError, match="taken right before it"):
            group.all_reduce(stale, out=np.empty((1, 4), np.float32))
        fresh = group.next_part(1, 4)
        fresh[:] = 2
        out = np.empty((1, 4), np.float32)
        group.all_reduce(fresh, out=out)
        assert (out == 2).all()
    finally:
        group.close()
