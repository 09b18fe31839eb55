"""Session stickiness without shared state: rendezvous (highest-random-weight) hashing of a session key over
the worker ids. Every router computes the same ranking from the key alone, so a session's turns go to the
same worker whichever router admits them, with no table to share. Removing a worker moves only the sessions
whose first choice it was (each to its own second choice); adding one takes only the sessions that now rank
it first."""

import hashlib
from collections.abc import Iterable


def session_ranking(session: str, worker_ids: Iterable[str]) -> list[str]:
    """worker_ids in the session's order of preference: its home first, then where it goes while the home
    is down or full. Stable across processes and runs (blake2b, not Python's salted hash)."""
    return sorted(worker_ids, key=lambda worker_id: _weight(session, worker_id), reverse=True)


def _weight(session: str, worker_id: str) -> bytes:
    return hashlib.blake2b(f"{session}\0{worker_id}".encode(), digest_size=8).digest()
