"""CallerLeases (actors/caller_lease.py): a worker aborts a caller's requests once its lease lapses, each
once, never a renewing caller's, and never on a check that follows a stall of the worker's own event loop."""

from actors.caller_lease import CHECK_INTERVAL_S, CallerLeases

LEASE_S, LATE_S = 0.75, 0.25


def ticking(leases: CallerLeases, start: float, end: float,
            renew: dict[str, float] | None = None) -> list[str]:
    """Check every CHECK_INTERVAL_S from start to end, renewing caller c every renew[c] s; what expired."""
    expired, now, last_renewal = [], start, dict.fromkeys(renew or {}, start)
    while now <= end:
        for caller, every in (renew or {}).items():
            if now - last_renewal[caller] >= every:
                leases.renew(caller, now)
                last_renewal[caller] = now
        expired += [r for ids in leases.expire(now).values() for r in ids]
        now += CHECK_INTERVAL_S
    return expired


def test_a_silent_callers_requests_expire_once_after_the_lease_and_a_renewing_callers_never():
    leases = CallerLeases(LEASE_S, LATE_S)
    for request_id in ("a1", "a2"):
        leases.add("alive", request_id, 0.0)
    for request_id in ("d1", "d2"):
        leases.add("dead", request_id, 0.0)
    assert ticking(leases, 0.0, LEASE_S - 0.01, renew={"alive": 0.2}) == []
    assert ticking(leases, LEASE_S, LEASE_S + 2 * CHECK_INTERVAL_S, renew={"alive": 0.2}) == ["d1", "d2"]
    assert ticking(leases, LEASE_S + 0.2, 30.0, renew={"alive": 0.2}) == []
    assert set(leases.request_ids) == {"alive"} and leases.num_expired == 1


def test_a_late_check_expires_nothing_and_the_next_one_sees_the_renewals_queued_behind_the_stall():
    leases = CallerLeases(LEASE_S, LATE_S)
    for caller in ("alive", "dead"):
        leases.add(caller, caller, 0.0)
    assert leases.expire(0.0) == {}
    assert leases.expire(5.0) == {}  # the worker's loop stalled 5 s: the callers' renewals queued behind it
    leases.renew("alive", 5.01)  # run just after the late check
    assert ticking(leases, 5.0 + CHECK_INTERVAL_S, 5.0 + LEASE_S) == ["dead"]  # at the first check on time


def test_a_caller_with_no_requests_left_is_forgotten_and_its_late_renewal_leaves_nothing():
    leases = CallerLeases(LEASE_S, LATE_S)
    leases.add("c", "r1", 0.0)
    leases.add("c", "r2", 0.0)
    leases.remove("c", "r1")
    assert leases.request_ids == {"c": {"r2"}}
    leases.remove("c", "r2")
    leases.renew("c", 0.1)
    leases.remove("c", "r2")  # ended twice (expired, then its stream closed): harmless
    assert leases.request_ids == {} and leases.renewed == {}
    leases.add("c", "r3", 10.0)  # back later: a fresh lease from its new request
    assert leases.expire(10.0) == {} and leases.expire(10.0 + LEASE_S / 2) == {}
