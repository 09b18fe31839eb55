"""EngineLoop: one Engine stepped by a background thread, shared by the callers of many threads.

Callers build and validate their requests in their own thread (tokenizing included: never in the loop that
serves the others) and hand them to the loop's inbox, each with an outbox of its own; then they wait on their
outboxes. The loop thread is the only one that touches the engine once it runs: between steps it takes the
inbox's messages (requests, aborts, calls such as registering an adapter or reading stats), it steps while any
of its requests is pending, and it sleeps on the inbox when none is. Requests from different threads so batch
together in the same steps, and a stream whose reader is slow holds up no one (its deltas wait in its outbox).

Why a loop thread rather than "the caller that holds the loop steps for everyone": a stream's reader pauses
between deltas for as long as it likes, so the holder would have to hand the loop over whenever its own
requests finish or its reader stops reading, and the others still need per-request queues; numba's thread
count is per thread (set_num_threads is thread-local), and one thread running every kernel keeps it set once;
and it is how the worker actor runs its engine (actors/worker.py). numba's kernels release the GIL, so the
callers' threads cost the loop nothing while it computes.

A failing step fails the requests it held (the running ones; every pending one if none was running) with its
exception and the loop goes on. close() fails what is still pending with EngineClosed and ends the thread;
later submissions and calls raise EngineClosed. Should the loop's own code fail, it closes the same way.
"""

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import numba

from cluster_configs.errors import EngineClosed
from scheduling.engine import Engine
from scheduling.outputs import RequestOutput
from scheduling.request import Request

# ---- what crosses between the callers' threads and the loop thread -------------------------------------


@dataclass(frozen=True)
class Submit:
    requests: tuple[Request, ...]
    outboxes: tuple[queue.SimpleQueue, ...]  # one per request: its RequestOutputs, or a RequestFailed
    # whether each step's delta goes to the outbox (a stream), or only the last (a caller that only waits
    # is not woken at every step)
    deltas: bool


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    """fn(engine), run on the loop thread between steps; its value or exception goes to result."""

    fn: Callable[[Engine], object]
    result: Future


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class RequestFailed:
    """The last item in the outbox of a request that a failing step (or close()) ended."""

    error: Exception


Message = Submit | Abort | Call | Stop


class Pending:
    """A caller's side of one submitted request: its outputs, as the loop thread hands them on."""

    def __init__(self, request: Request):
        self.request = request
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()

    def outputs(self) -> Iterator[RequestOutput]:
        """Its outputs (each step's delta if submitted with deltas, else the last) until it finishes; raises
        the error that failed it."""
        while True:
            item = self.outbox.get()
            if isinstance(item, RequestFailed):
                raise item.error
            yield item
            if item.finished:
                return

    def wait(self) -> Request:
        """The request, once finished (its state is the loop thread's no more)."""
        for _ in self.outputs():
            pass
        return self.request


class EngineLoop:
    def __init__(self, engine: Engine):
        self.engine = engine
        # SimpleQueue.put is reentrant: a stream the garbage collector finalizes, in any thread and at any
        # point, may queue its abort
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders close() against submissions: nothing is queued after Stop
        self._closed = False
        self._outboxes: dict[str, queue.SimpleQueue] = {}  # the loop thread's: its pending requests
        self._streamed: set[str] = set()  # of those, the ones whose every delta is delivered
        self._thread = threading.Thread(target=self._run, name="numaserve-engine-loop", daemon=True)
        self._thread.start()

    def submit(self, requests: list[Request], deltas: bool = False) -> list[Pending]:
        """Queue validated requests (made by engine.make_request) for the next step. deltas: their outputs are
        each step's delta (else only the last, with finish_reason)."""
        pending = [Pending(r) for r in requests]
        self._send(Submit(tuple(requests), tuple(p.outbox for p in pending), deltas))
        return pending

    def call(self, fn: Callable[[Engine], object]):
        """fn(engine) run on the loop thread between steps: its value, or its exception raised here."""
        result = Future()
        self._send(Call(fn, result))
        return result.result()

    def abort(self, request_id: str) -> None:
        """End a request (finish_reason "abort") before the next step; unknown or finished ids are ignored."""
        self._inbox.put(Abort(request_id))

    def close(self) -> None:
        """Fail what is pending with EngineClosed and end the loop thread (after its step in flight)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._inbox.put(Stop())
        if threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def closed(self) -> bool:
        return self._closed

    def _send(self, message: Message) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosed("this LLM is closed; create a new numaserve.LLM to go on")
            self._inbox.put(message)

    # ---- the loop thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        numba.set_num_threads(self.engine.num_threads)  # thread-local: this thread runs the kernels
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001  (a bug in the loop itself: answer everyone, then stop)
            self._crash(e)

    def _serve(self) -> None:
        running = True
        while running:
            running = self._handle(self._inbox.get())  # idle: sleeps until a message comes
            while running and self._outboxes:
                self._step()
                running = self._drain()

    def _drain(self) -> bool:
        """Handle every queued message; -> False once told to stop."""
        try:
            while True:
                if not self._handle(self._inbox.get_nowait()):
                    return False
        except queue.Empty:
            return True

    def _handle(self, message: Message) -> bool:
        match message:
            case Submit(requests, outboxes, deltas):
                for req, outbox in zip(requests, outboxes):
                    self._outboxes[req.request_id] = outbox
                    if deltas:
                        self._streamed.add(req.request_id)
                    self.engine.submit(req)
            case Abort(request_id):
                if request_id in self._outboxes and (out := self.engine.abort(request_id)) is not None:
                    self._deliver([out])
            case Call(fn, result):
                try:
                    result.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001  (the caller gets it)
                    result.set_exception(e)
            case Stop():
                self._fail(list(self._outboxes), EngineClosed("the LLM was closed before this request "
                                                              "finished"))
                return False
        return True

    def _step(self) -> None:
        try:
            step = self.engine.step()
        except Exception as e:  # noqa: BLE001  (a bug fails the requests it hit, not the loop)
            held = [r.request_id for r in self.engine.scheduler.running if r.request_id in self._outboxes]
            self._fail(held or list(self._outboxes), e)
            return
        self._deliver(step.outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished:
                self._streamed.discard(out.request_id)
                outbox = self._outboxes.pop(out.request_id, None)
            else:
                outbox = self._outboxes.get(out.request_id) if out.request_id in self._streamed else None
            if outbox is not None:
                outbox.put(out)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._streamed.discard(request_id)
            self._outboxes.pop(request_id).put(RequestFailed(error))

    def _crash(self, error: Exception) -> None:
        """Close, and fail every pending request and queued message with EngineClosed."""
        with self._lock:
            self._closed = True  # nothing but aborts is queued from here on
        failure = EngineClosed(f"the engine's loop failed ({error!r}); create a new numaserve.LLM to go on")
        outboxes = list(self._outboxes.values())
        self._outboxes.clear()
        self._streamed.clear()
        try:
            while True:
                match self._inbox.get_nowait():
                    case Submit(_, queued, _):
                        outboxes += queued
                    case Call(_, result):
                        result.set_exception(failure)
        except queue.Empty:
            pass
        for outbox in outboxes:
            outbox.put(RequestFailed(failure))
