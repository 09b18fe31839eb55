"""FreshValue: a value that an endpoint answers from memory while a single background ask keeps it fresh.

/health asked the router, which asked every worker, on every call: a round trip that stretched with whatever
slowed any actor on the way. vLLM's /health reads the engine's state in the server's own process; here a call
answers the last count at once and, when it is older than refresh_s, starts one ask in the background (never
two at a time). A count older than max_age_s is not answered: the call waits for the ask. So an answer is at
most max_age_s old, and a /health poll costs no Ray call while another is under way. ask answers and never
raises (for /health a failure is an answer: no worker serves).
"""

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class FreshValue(Generic[T]):
    def __init__(self, ask: Callable[[], Awaitable[T]], refresh_s: float, max_age_s: float,
                 clock: Callable[[], float] = time.monotonic):
        assert 0 < refresh_s <= max_age_s, (refresh_s, max_age_s)
        self.ask = ask
        self.refresh_s = refresh_s
        self.max_age_s = max_age_s
        self.clock = clock
        self.value: T | None = None
        self.asked_at = -float("inf")  # when the ask that gave self.value started
        self.asking: asyncio.Task | None = None
        self.num_asks = 0

    async def get(self) -> T:
        age = self.clock() - self.asked_at
        if age >= self.refresh_s and self.asking is None:
            self.asking = asyncio.ensure_future(self._refresh())
            self.num_asks += 1
        if age >= self.max_age_s:
            await asyncio.shield(self.asking)  # a caller that goes away leaves the ask to the next one
        return self.value

    async def _refresh(self) -> None:
        started = self.clock()
        try:
            self.value = await self.ask()
            self.asked_at = started
        finally:
            self.asking = None
