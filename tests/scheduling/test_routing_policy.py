"""Routing (session > prefix affinity > adapter affinity > least outstanding tokens, admission bound) and the
batching policy."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import numaserve as ns
from memory.block_pool import BlockPool, prefix_cache_key
from memory.kv_cache import kv_layout
from scheduling.kv_cache_manager import KVCacheManager
from scheduling.policy import MIN_TOKEN_BUDGET, BatchingPolicy, Policy, PolicyLimits, StepTelemetry
from scheduling.request import Request
from scheduling.routing import ADAPTER_LOAD_TOKENS, NUM_AFFINITY_BLOCKS, RoutingPolicy
from tests.conftest import random_prompt

BS = 16


def routing(num_workers=2, bound=100) -> RoutingPolicy:
    return RoutingPolicy([f"w{i}" for i in range(num_workers)], BS, bound)


def test_least_outstanding_tokens_wins_and_finishing_releases_the_load():
    r = routing()
    assert r.route("a", random_prompt(100, 1), 50) == "w0"
    assert r.route("b", random_prompt(10, 2), 10) == "w1"  # w0 carries 150 tokens
    assert r.route("c", random_prompt(10, 3), 10) == "w1"  # w1 carries 20 < 150
    r.finish("a")
    assert r.route("d", random_prompt(10, 4), 10) == "w0"
    assert r.workers["w0"].num_tokens == 20 and r.workers["w1"].num_tokens == 40


def test_a_request_costs_its_admission_and_its_end_and_a_reroute_only_when_its_worker_is_lost():
    r = routing()
    r.route("a", random_prompt(30, 1), 20)
    assert r.workers["w0"].num_tokens == 50  # until it ends: no progress is relayed
    r.mark_down("w0")
    assert r.reroute("a", 15) == "w1"
    r.finish("a")
    r.finish("unknown")  # a restarted router's caller: counted, nothing to release
    assert r.num_calls == {"admit": 1, "finish": 2, "reroute": 1}
    assert all(w.num_tokens == 0 and w.num_requests == 0 for w in r.workers.values())


def test_a_session_sticks_to_its_worker_while_it_admits():
    r = routing(bound=3)
    first = r.route("s1", random_prompt(5, 1), 400, session="chat")
    r.route("x", random_prompt(5, 2), 10)  # the other worker is now lighter
    assert r.route("s2", random_prompt(5, 3), 10, session="chat") == first
    assert r.num_routed["session"] == 2  # its first turn too: the key, not a table, names its worker
    r.route("s3", random_prompt(5, 4), 10, session="chat")  # first is now at its bound of 3
    assert r.route("s4", random_prompt(5, 5), 10, session="chat") != first  # re-bound to a worker that admits


def test_a_pinned_session_goes_to_its_worker_while_it_lives_and_elsewhere_once_it_is_down():
    r = routing(bound=2)
    r.route("x", random_prompt(5, 1), 400)  # w0 is the heavier
    assert r.route("t1", random_prompt(5, 2), 10, pinned="w0") == "w0"
    assert r.num_routed["session"] == 1
    with pytest.raises(ns.Overloaded, match="session's worker w0"):  # at its bound of 2: not moved away
        r.route("t2", random_prompt(5, 3), 10, pinned="w0")
    r.mark_down("w0")
    assert r.route("t3", random_prompt(5, 4), 10, pinned="w0") == "w1"


def test_a_shared_prefix_goes_where_its_blocks_are_cached():
    r = routing()
    system = random_prompt(3 * BS, 7)
    home = r.route("a", system + random_prompt(5, 1), 10)
    r.route("b", random_prompt(40, 2), 10)  # load the other worker a little less than home
    assert r.route("c", system + random_prompt(9, 3), 10) == home
    assert r.num_routed["prefix"] == 1


def test_prefix_affinity_yields_to_a_large_imbalance():
    r = routing()
    system = random_prompt(2 * BS, 7)
    home = r.route("a", system + [5], 5000)
    assert r.route("b", system + [6], 10) != home


def test_an_adapter_goes_where_it_was_last_served_until_the_imbalance_outweighs_loading_it():
    r = routing()
    home = r.route("a", random_prompt(20, 1), 10, adapter="tests")
    r.route("b", random_prompt(10, 2), 10)  # the other worker is lighter
    assert r.route("c", random_prompt(20, 3), 10, adapter="tests") == home
    assert r.num_routed["adapter"] == 1
    assert r.route("d", random_prompt(20, 4), 10, adapter="library") != home  # no holder: the lighter one
    assert r.route("e", random_prompt(10, 5), ADAPTER_LOAD_TOKENS + 100, adapter="tests") == home  # now heavy
    assert r.route("f", random_prompt(20, 6), 10, adapter="tests") != home
    assert r.num_routed["adapter"] == 2 and r.num_routed["load"] == 4


def test_prefix_hashes_cover_only_full_leading_blocks_and_depend_on_the_adapter():
    r = routing()
    assert r.prefix_hashes(random_prompt(BS - 1, 1)) == []
    assert len(r.prefix_hashes(random_prompt(BS * 10, 1))) == NUM_AFFINITY_BLOCKS
    p = random_prompt(2 * BS, 1)
    assert r.prefix_hashes(p, prefix_cache_key("a", None)) != r.prefix_hashes(p, prefix_cache_key("b", None))
    assert r.prefix_hashes(p + [1, 2]) == r.prefix_hashes(p)


@pytest.mark.parametrize("adapter, cache_salt", [(None, None), ("a", None), (None, "tenant"),
                                                 ("a", "tenant")])
def test_prefix_hashes_are_the_hashes_the_engine_commits_its_blocks_under(adapter, cache_salt):
    """The router sends a prompt where blocks hashed as the worker's engine hashes them are cached."""
    prompt = random_prompt(5 * BS + 3, 2)
    req = Request("r", prompt, ns.SamplingParams(max_tokens=1), adapter_id=adapter, cache_salt=cache_salt,
                  max_model_len=1024)
    layout = kv_layout(1, 16, BS, 1, 1, "float32")  # bookkeeping only: no arrays
    kv = KVCacheManager(BlockPool(16), layout, enable_prefix_caching=True, sliding_window=0)
    assert kv.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    kv.commit_full_blocks(req)
    hashes = routing().prefix_hashes(prompt, prefix_cache_key(adapter, cache_salt))
    assert hashes == req.block_hashes[:NUM_AFFINITY_BLOCKS]


def test_overloaded_when_every_live_worker_is_at_its_bound_and_admits_again_after():
    r = routing(bound=2)
    for i in range(4):
        r.route(f"r{i}", [1, 2, 3], 5)
    with pytest.raises(ns.Overloaded, match="every worker's queue is full"):
        r.route("r4", [1, 2, 3], 5)
    r.finish("r0")
    assert r.route("r4", [1, 2, 3], 5) == "w0"


def test_dead_workers_get_nothing_and_their_requests_move_to_the_least_loaded_live_one():
    r = routing(num_workers=3, bound=1)
    for i in range(3):
        r.route(f"r{i}", [1], 10)
    r.mark_down("w1")
    assert r.reroute("r1", 7) == "w0"  # past its bound: an admitted request is never dropped
    assert r.workers["w1"].num_requests == 0 and r.workers["w1"].num_tokens == 0
    assert r.workers["w0"].num_requests == 2 and r.workers["w0"].num_tokens == 11 + 7
    r.finish("r0")
    r.finish("r1")
    assert r.route("r3", [1], 1) == "w0"
    for w in ("w0", "w2"):
        r.mark_down(w)
    with pytest.raises(ns.Overloaded, match="no worker is available"):
        r.route("r4", [1], 1)
    assert r.reroute("r3", 1) is None
    r.mark_up("w1")
    assert r.route("r5", [1], 1) == "w1"


def test_a_sweep_releases_only_old_requests_their_worker_no_longer_runs():
    now = [0.0]
    r = RoutingPolicy(["w0"], 16, 8, clock=lambda: now[0])
    r.route("gone", [1] * 8, 8)
    r.route("running", [1] * 8, 8)
    now[0] = 5.0
    r.route("young", [1] * 8, 8)  # placed, its stream not started yet
    assert r.sweep("w0", {"running"}, grace_s=10.0) == []
    now[0] = 12.0
    assert r.sweep("w0", {"running"}, grace_s=10.0) == ["gone"]
    assert set(r.routes) == {"running", "young"} and r.workers["w0"].num_tokens == 32
    assert r.num_swept == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["route", "finish", "down", "up", "reroute"]),
                          st.integers(0, 9), st.integers(1, 50)), max_size=80))
def test_accounting_invariants_hold_under_any_sequence_of_events(events):
    r = routing(num_workers=3, bound=4)
    live: set[str] = set()
    for kind, i, n in events:
        rid, worker = f"r{i}", f"w{i % 3}"
        if kind == "route" and rid not in live:
            try:
                r.route(rid, [1] * n, n)
                live.add(rid)
            except ns.Overloaded:
                assert not any(w.admits for w in r.workers.values())
        elif kind == "finish":
            r.finish(rid)
            live.discard(rid)
        elif kind == "down":
            r.mark_down(worker)
        elif kind == "up":
            r.mark_up(worker)
        elif kind == "reroute" and rid in live and r.reroute(rid, n) is None:
            live.discard(rid)  # no live worker: the request is dropped from the accounting
        assert set(r.routes) == live
        for w in r.workers.values():
            assert w.request_ids == {q for q, route in r.routes.items() if route.worker_id == w.worker_id}
            assert w.num_tokens == sum(r.routes[q].num_tokens for q in w.request_ids) >= 0


LIMITS = PolicyLimits(max_token_budget=512, max_num_seqs=64, max_queued=16, target_step_s=0.1)


def telemetry(**fields) -> StepTelemetry:
    base = {"worker_id": "w0", "num_running": 8, "num_waiting": 0, "num_steps": 10, "num_batched_tokens": 80,
            "step_time_s": 0.02, "kv_usage": 0.5, "num_preemptions": 0}
    return StepTelemetry(**(base | fields))


def test_initial_policy_is_the_configured_limits():
    assert BatchingPolicy(LIMITS).initial() == Policy(512, 64, 80)


def test_preemptions_cut_the_sequence_cap_and_the_admission_bound_with_it():
    p = BatchingPolicy(LIMITS)
    p.update(telemetry(num_preemptions=3))  # the first report only sets the baseline
    cut = p.update(telemetry(num_running=40, num_preemptions=5))
    assert cut.max_num_seqs == 30 and cut.admission_bound == 30 + 16


def test_a_full_kv_pool_cuts_the_cap_and_a_roomy_one_lets_it_grow_back():
    p = BatchingPolicy(LIMITS)
    cut = p.update(telemetry(num_running=20, kv_usage=0.97))
    assert cut.max_num_seqs == 15
    grown = p.update(telemetry(kv_usage=0.3))
    assert grown.max_num_seqs == 15 + 64 // 16
    for _ in range(50):
        grown = p.update(telemetry(kv_usage=0.3))
    assert grown.max_num_seqs == 64


def test_slow_steps_shrink_the_token_budget_fast_ones_restore_it():
    p = BatchingPolicy(LIMITS)
    slow = p.update(telemetry(step_time_s=0.4))
    assert slow.token_budget == 128
    floor = p.update(telemetry(step_time_s=100.0, num_running=40))
    assert floor.token_budget == MIN_TOKEN_BUDGET  # the smallest chunk that keeps prefill near its best rate
    floor = p.update(telemetry(step_time_s=100.0, num_running=100))
    assert floor.token_budget == 100  # one decode token per running request, at least
    for _ in range(10):
        fast = p.update(telemetry(step_time_s=0.01))
    assert fast.token_budget == 512
    idle = p.update(telemetry(num_steps=0, step_time_s=0.0))
    assert idle.token_budget == 512


def test_policies_are_kept_per_worker():
    p = BatchingPolicy(LIMITS)
    p.update(telemetry(worker_id="a", step_time_s=0.4))
    assert p.policy("b") == p.initial() and p.policy("a").token_budget == 128
