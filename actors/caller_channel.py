"""A caller's channel on a worker: the deltas of all its requests there, gathered on the actor's event loop
and released together, so a step makes one Ray item per caller however many streams it serves
(NumaWorker.caller_stream; the caller's side: actors/worker_feed.py).

A batch is released when one of its requests ends, or delivers its first delta, or the hold after the
previous batch has passed (stream_interval_s: one timer per batch, not per token or per request). The channel
ends when its caller's lease lapses (its requests aborted here; nothing more is sent: a yield to a dead
caller held up the worker's next call) or after IDLE_S with no request of its caller here (a caller's next
request opens a new one). A caller that lives on (its event loop stalled) calls again and learns which of its
requests are gone (NumaWorker.caller_stream).
"""

import asyncio

from scheduling.outputs import RequestOutput

IDLE_S = 2.0
Item = RequestOutput | Exception
Batch = list[tuple[str, Item]]  # (request id, its deltas merged, or the exception that ended it)


def merge(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """Several deltas of one request that are ready together, as one."""
    logprobs = None if outputs[0].logprobs is None else [lp for o in outputs for lp in o.logprobs]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    token_ids, text = [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs)
    return RequestOutput(request_id, token_ids, text, outputs[-1].finish_reason, logprobs, prompt_logprobs)


class CallerChannel:
    """One caller's pending items on a worker's event loop, released by take() as batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop, idle_s: float = IDLE_S):
        self.loop, self.idle_s = loop, idle_s
        self.pending: dict[str, list[Item]] = {}  # request id -> its items since the last batch
        self.unstarted: set[str] = set()  # requests whose first delta has not been released
        self.num_running = 0  # requests of this caller here, opened and not ended
        self.ready = asyncio.Event()  # set: a batch is due
        self.hold_until = 0.0
        self.closed = False

    def opened(self, request_id: str) -> None:
        """A new request of this caller: put() takes its items until one ends it."""
        self.num_running += 1
        self.unstarted.add(request_id)

    def forget(self, request_id: str) -> None:
        """A request opened here that never reached the engine (its submission failed: the caller has the
        error)."""
        self.num_running -= 1
        self.unstarted.discard(request_id)

    def put(self, request_id: str, item: Item) -> None:
        """On the actor's event loop (a closed channel drops it: its caller is gone)."""
        ended = isinstance(item, Exception) or item.finished
        if ended:
            self.num_running -= 1
        if self.closed:
            return
        self.pending.setdefault(request_id, []).append(item)
        if ended or request_id in self.unstarted or self.loop.time() >= self.hold_until:
            self.ready.set()

    def close(self) -> None:
        """The caller's lease lapsed (the worker aborted its requests here): what is pending is dropped, and
        take() ends the channel."""
        self.pending = {}
        self.closed = True
        self.ready.set()

    def hold(self, seconds: float) -> None:
        """No batch before seconds from now unless a request ends or starts."""
        if seconds > 0:
            self.hold_until = self.loop.time() + seconds
            self.loop.call_at(self.hold_until, self._release)

    def _release(self) -> None:
        if self.pending:
            self.ready.set()

    async def take(self) -> Batch | None:
        """The next batch, each request's deltas merged (an exception, if one ended it, alone); None once the
        channel is over: closed, or idle_s without a request of its caller."""
        while not (self.ready.is_set() and self.pending):
            self.ready.clear()
            if self.closed:
                return None
            idle = not self.pending and self.num_running == 0
            try:
                await asyncio.wait_for(self.ready.wait(), self.idle_s if idle else None)
            except TimeoutError:
                if not self.pending and self.num_running == 0:
                    return None
        self.ready.clear()
        pending, self.pending = self.pending, {}
        self.unstarted.difference_update(pending)
        return [(request_id, _one(request_id, items)) for request_id, items in pending.items()]


def _one(request_id: str, items: list[Item]) -> Item:
    failure = next((i for i in items if isinstance(i, Exception)), None)
    return failure if failure is not None else merge(request_id, items)
