"""Caller leases: a worker aborts the requests of a caller that went away (its process killed, its HTTP actor
killed) within a second, where Ray would let them run on to max_tokens.

Ray gives nothing fast enough for free: the worker's async streaming generator is not cancelled when its
caller dies, neither a driver killed with SIGKILL nor an actor killed with ray.kill (it yields on into a
stream nobody owns); a worker awaiting an ObjectRef the caller owns gets OwnerDiedError only after a fixed
delay, longer than a lease (whatever its cause in Ray). So each caller holds a lease on the workers it streams
from: it renews it every RENEW_INTERVAL_S with one call per worker (not per request or per chunk), and a
worker whose lease from a caller is older than LEASE_S aborts that caller's requests. A kill lands at most
RENEW_INTERVAL_S after a renewal, so its requests end LEASE_S - RENEW_INTERVAL_S .. LEASE_S after it, plus one
check interval and one engine step.

A stalled event loop must not look like a dead caller: renewals queued behind a worker's stall may land
just after the check that wakes from it, so a check that comes late expires nothing (the next one, on time,
sees them); a caller's own loop stalled past LEASE_S - RENEW_INTERVAL_S does lose its requests.
"""

import asyncio
import uuid

RENEW_INTERVAL_S = 0.2
LEASE_S = 0.75
CHECK_INTERVAL_S = 0.05
LATE_CHECK_S = 0.25  # a check this long after the previous one follows a stall of the worker's event loop


class CallerGone(Exception):
    """A worker's answer for a request it no longer runs for its caller (the caller's lease lapsed and the
    worker aborted it): a caller that lives on (its event loop stalled) resumes it as after a lost worker."""


class CallerLeases:
    """A worker's view of its callers: which of its requests each caller streams, and when it last renewed.
    Plain data; the worker calls it from its event loop with the time (time.monotonic)."""

    def __init__(self, lease_s: float = LEASE_S, late_check_s: float = LATE_CHECK_S):
        self.lease_s, self.late_check_s = lease_s, late_check_s
        self.renewed: dict[str, float] = {}  # caller id -> its last renewal (or its first request here)
        self.request_ids: dict[str, set[str]] = {}  # caller id -> its requests streaming here
        self._last_check: float | None = None
        self.num_expired = 0  # callers whose lease lapsed (a live one among them lost its requests)

    def add(self, caller_id: str, request_id: str, now: float) -> None:
        if caller_id not in self.request_ids:
            self.renewed[caller_id] = now
            self.request_ids[caller_id] = set()
        self.request_ids[caller_id].add(request_id)

    def remove(self, caller_id: str, request_id: str) -> None:
        """request_id ended here (finished, aborted, or its caller expired)."""
        ids = self.request_ids.get(caller_id)
        if ids is not None:
            ids.discard(request_id)
            if not ids:
                del self.request_ids[caller_id], self.renewed[caller_id]

    def renew(self, caller_id: str, now: float) -> None:
        """A caller with no request here has nothing to renew (a late renewal leaves no entry behind)."""
        if caller_id in self.renewed:
            self.renewed[caller_id] = now

    def expire(self, now: float) -> dict[str, list[str]]:
        """caller id -> its requests, for the callers whose lease lapsed, each returned once (the callers
        are forgotten)."""
        late = self._last_check is not None and now - self._last_check > self.late_check_s
        self._last_check = now
        if late:
            return {}
        lapsed = [c for c, at in self.renewed.items() if now - at > self.lease_s]
        self.num_expired += len(lapsed)
        for caller_id in lapsed:
            del self.renewed[caller_id]
        return {caller_id: sorted(self.request_ids.pop(caller_id)) for caller_id in lapsed}


class LeaseKeeper:
    """A caller's side: renews its lease on every worker one of its open streams is on, every
    RENEW_INTERVAL_S, from a task on the caller's event loop that runs while any stream is open."""

    def __init__(self):
        self.caller_id = uuid.uuid4().hex
        self.streams: set = set()  # open RequestStreams (actors/request_stream.py)
        self._task: asyncio.Task | None = None

    def opened(self, stream) -> None:
        self.streams.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._renew())

    def closed(self, stream) -> None:
        self.streams.discard(stream)

    async def _renew(self) -> None:
        while self.streams:
            workers = {s.placement.worker_id: s.placement.worker for s in self.streams}
            for worker in workers.values():
                worker.renew_lease.remote(self.caller_id)  # not awaited: a lost worker's answer is moot
            await asyncio.sleep(RENEW_INTERVAL_S)
