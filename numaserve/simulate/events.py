"""The simulator's clock: a heap of timed callbacks, and the FIFO servers that model one Python event loop's
CPU (the router's, a caller's)."""

import heapq
from collections.abc import Callable


class EventQueue:
    def __init__(self):
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._seq = 0  # ties run in the order they were scheduled: the run is deterministic

    def at(self, time: float, fn: Callable, *args) -> None:
        heapq.heappush(self._heap, (time, self._seq, fn, args))
        self._seq += 1

    def run(self) -> None:
        heap = self._heap
        while heap:
            self.now, _, fn, args = heapq.heappop(heap)
            fn(*args)

    def __len__(self) -> int:
        return len(self._heap)


class FifoServer:
    """One event loop serving calls in the order they reach it, each for its CPU seconds. Calls must reach it
    in time order (book them from events at their arrival time): then booking is exact FIFO."""

    def __init__(self):
        self.free_at = 0.0
        self.busy_s = 0.0
        self.num_calls = 0

    def serve(self, now: float, seconds: float) -> float:
        """A call arriving now -> when it is done."""
        self.free_at = max(now, self.free_at) + seconds
        self.busy_s += seconds
        self.num_calls += 1
        return self.free_at
