"""A request on a worker from its submission to its last item: where its items go, and what its end lets go
of (NumaWorker._ended)."""

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from scheduling.outputs import RequestOutput

KEEP_S = 120.0


@dataclass(eq=False)
class Running:
    request_id: str
    admission_id: str | None  # the router's, while it counts the request here
    caller_id: str | None  # whose lease keeps it alive (None: an embedding, awaited by its call)
    adapter: str | None
    deliver: Callable[[RequestOutput | Exception], None]  # its caller's channel, or its call's future
    ended: Callable[["Running"], None]  # the worker's bookkeeping, once its last item is put
    using_adapter: bool = False  # the adapter's weights are in use for it (fetched)
    submitted: bool = False  # sent to the engine loop
    aborted: bool = False  # aborted before it was submitted (while its adapter was fetched)

    def put(self, item: RequestOutput | Exception) -> None:
        """On the actor's event loop (scheduling/loop_messages.Outbox): the engine loop's items for it."""
        self.deliver(item)
        if isinstance(item, Exception) or item.finished:
            self.ended(self)


class RecentIds:
    """Request ids remembered for keep_s (time.monotonic): what a worker must know of a request it cannot
    find, asked later by a call Ray may deliver in any order (an async actor's calls from one caller are
    not run in the order they were made)."""

    def __init__(self, keep_s: float = KEEP_S):
        self.keep_s = keep_s
        self.added: dict[str, float] = {}  # id -> when (in order)

    def add(self, request_id: str, now: float) -> None:
        while self.added:  # the oldest first: forget what is past keep_s
            oldest, at = next(iter(self.added.items()))
            if now - at <= self.keep_s:
                break
            del self.added[oldest]
        self.added.pop(request_id, None)
        self.added[request_id] = now

    def pop(self, request_id: str) -> bool:
        """Whether request_id was remembered (then forgotten)."""
        return self.added.pop(request_id, None) is not None


def settle(done: asyncio.Future, item: RequestOutput | Exception) -> None:
    """An awaited request's items: its end settles done (a failure raises there)."""
    if done.done():
        return
    if isinstance(item, Exception):
        done.set_exception(item)
    elif item.finished:
        done.set_result(item)
