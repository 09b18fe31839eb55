"""Session stickiness by rendezvous hashing (scheduling/session_hash.py): every router places a session alike,
and a worker joining or leaving moves only its own sessions."""

from hypothesis import given
from hypothesis import strategies as st

from scheduling.routing import RoutingPolicy
from scheduling.session_hash import session_ranking
from tests.conftest import random_prompt

WORKERS = [f"m{m}-numa{n}-0" for m in range(4) for n in range(2)]
SESSIONS = [f"session-{i}" for i in range(2000)]


def homes(worker_ids: list[str]) -> dict[str, str]:
    return {s: session_ranking(s, worker_ids)[0] for s in SESSIONS}


@given(st.permutations(WORKERS))
def test_the_ranking_depends_on_the_key_and_the_worker_set_only(order):
    assert session_ranking("chat-7", order) == session_ranking("chat-7", WORKERS)
    assert sorted(session_ranking("chat-7", order)) == sorted(WORKERS)


def test_removing_a_worker_moves_only_its_sessions_each_to_its_second_choice():
    before = homes(WORKERS)
    gone = WORKERS[3]
    after = homes([w for w in WORKERS if w != gone])
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved == {s for s in SESSIONS if before[s] == gone}
    assert all(after[s] == session_ranking(s, WORKERS)[1] for s in moved)


def test_adding_a_worker_takes_only_the_sessions_that_now_rank_it_first():
    before = homes(WORKERS)
    after = homes(WORKERS + ["m9-numa0-0"])
    moved = {s for s in SESSIONS if before[s] != after[s]}
    assert moved and all(after[s] == "m9-numa0-0" for s in moved)


def test_sessions_spread_over_the_workers():
    counts = {w: 0 for w in WORKERS}
    for home in homes(WORKERS).values():
        counts[home] += 1
    mean = len(SESSIONS) / len(WORKERS)
    assert all(0.75 * mean < c < 1.25 * mean for c in counts.values()), counts


def test_two_routers_with_different_loads_place_a_session_on_the_same_worker():
    a, b = (RoutingPolicy(WORKERS[:4], 16, 2) for _ in range(2))
    for i in range(3):  # router a's view: other requests load some workers
        a.route(f"x{i}", random_prompt(20, i), 500)
    home = session_ranking("chat", WORKERS[:4])[0]
    assert a.route("a1", random_prompt(5, 9), 10, session="chat") == home
    assert b.route("b1", random_prompt(5, 9), 10, session="chat") == home
    assert a.route("a2", random_prompt(5, 9), 10, session="chat") == home  # home now at a's bound of 2
    second = session_ranking("chat", WORKERS[:4])[1]
    assert a.route("a3", random_prompt(5, 9), 10, session="chat") == second


def test_fallbacks_follow_the_sessions_ranking_else_the_load_and_skip_full_workers():
    r = RoutingPolicy(WORKERS[:4], 16, 1)
    ranking = session_ranking("chat", WORKERS[:4])
    assert r.fallbacks(ranking[0], session="chat") == ranking[1:]
    r.route("x", random_prompt(20, 1), 500)  # fills the first worker (bound 1)
    r.route("y", random_prompt(20, 2), 10)  # fills the second
    assert r.fallbacks(WORKERS[3]) == [WORKERS[2]]
