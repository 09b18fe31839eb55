"""EngineLoop: the one thread that owns an Engine and steps it, for every front door (numaserve.LLM and its
sessions, the worker actor, the in-process HTTP deployment). Doors add behaviour as LoopHooks, not loops.

Callers build and validate their requests in their own thread (tokenizing included: never in the loop that
serves the others) and send them with an outbox each (scheduling/loop_messages.py). Between steps the loop
thread takes its inbox's messages (requests, aborts, calls such as registering an adapter or reading stats,
pause and advance); it steps while the engine has unfinished requests and is not paused, and sleeps on the
inbox otherwise. Requests from different threads so batch in the same steps, and a slow reader holds up no
one (its deltas wait in its outbox). numba's thread count is per thread, so one thread runs every kernel;
the kernels release the GIL, so the callers' threads cost the loop nothing while it computes.

One failure rule: a step that raises fails the requests it held (the running ones; every pending one if none
was running) with its exception (hooks.failure may map it), and the loop goes on; an error after which the
engine cannot step again (RankLost) goes to hooks.fatal first. close() fails what is pending with
EngineClosed and ends the thread; later submissions and calls raise EngineClosed. Should the loop's own code
fail, it closes the same way.
"""

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future

import numba

from cluster_configs.errors import EngineClosed, InvalidRequest, RankLost
from scheduling.loop_hooks import LoopHooks
from scheduling.loop_messages import (
    Abort,
    Advance,
    Call,
    Message,
    Outbox,
    RequestFailed,
    SetPaused,
    Stop,
    Submit,
)
from scheduling.outputs import RequestOutput
from scheduling.request import Request

IDLE_WAIT_S = 0.02  # a loop with requests it cannot step (paused, or on disk) wakes this often for deadlines

log = logging.getLogger(__name__)


def _disk_read_ended(engine) -> None:
    engine.finish_disk_reads()


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


def texts(outputs: Generator[RequestOutput]) -> Iterator[str]:
    """The non-empty text deltas of a stream of outputs (EngineLoop.stream); closing this closes it."""
    with contextlib.closing(outputs):
        for out in outputs:
            if out.text:
                yield out.text


class EngineLoop:
    def __init__(self, engine, hooks: LoopHooks | None = None, name: str = "numaserve-engine-loop"):
        """Start the loop thread; returns once hooks.started ran on it, raising what failed there."""
        self.engine, self.hooks = engine, hooks or LoopHooks()
        # SimpleQueue.put is reentrant: a stream the garbage collector finalizes, in any thread and at any
        # point, may queue its abort
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders close() against submissions: nothing is queued after Stop
        self._closed = False
        self.num_threads = 0  # numba's threads on the loop thread, once started
        # the loop thread's own state
        self._outboxes: dict[str, Outbox] = {}  # its pending requests
        self._streamed: set[str] = set()  # of those, the ones whose every delta is delivered
        self._paused = False
        self._advancing: tuple[int, Future] | None = None  # paused: steps still to take, who waits
        self._tick_s: float | None = None  # until the hooks' next tick
        self._failure: BaseException | None = None
        # a read from the prefix cache's disk tier that ends wakes the loop: its blocks join the pool (its
        # request, if not aborted meanwhile, can be scheduled)
        engine.on_disk_read(lambda: self._inbox.put(Call(_disk_read_ended, None)))
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name=name, daemon=True)
        self._thread.start()
        ready.wait()
        if self._failure is not None:
            raise self._failure

    # ---- the callers' side -----------------------------------------------------------------------------

    def submit(self, requests: list[Request], deltas: bool = False) -> list[Pending]:
        """Queue validated requests (made by engine.make_request) for the next step. deltas: their outputs are
        each step's delta (else only the last, with finish_reason)."""
        pending = [Pending(r) for r in requests]
        self.send(Submit(tuple(requests), tuple(p.outbox for p in pending), deltas))
        return pending

    def run(self, requests: list[Request]) -> list[Request]:
        """Submit requests and wait until all finished; if one fails (or the caller is interrupted) the rest
        are aborted."""
        pending = self.submit(requests)
        try:
            return [p.wait() for p in pending]
        except BaseException:
            for p in pending:
                self.abort(p.request.request_id)
            raise

    def stream(self, request: Request) -> Generator[RequestOutput]:
        """Submit request; its outputs, a delta per step. Closing the iterator (or dropping it) aborts it."""
        [pending] = self.submit([request], deltas=True)
        finished = False
        try:
            for out in pending.outputs():
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.abort(request.request_id)

    def call(self, fn: Callable[[object], object]):
        """fn(engine) run on the loop thread between steps: its value, or its exception raised here."""
        return self.call_future(fn).result()

    def call_future(self, fn: Callable[[object], object]) -> Future:
        """fn(engine) run on the loop thread between steps; its value or exception in the future."""
        result = Future()
        self.send(Call(fn, result))
        return result

    def post(self, fn: Callable[[object], object]) -> None:
        """fn(engine) run on the loop thread between steps; nobody waits for it (an exception is logged)."""
        self._inbox.put(Call(fn, None))

    def set_paused(self, paused: bool) -> Future:
        """Pause (take no step: requests in flight stay where they are) or resume; done once the loop has
        taken the message, so no step starts after a pause's future is done."""
        result = Future()
        self.send(SetPaused(paused, result))
        return result

    def advance(self, num_steps: int) -> Future:
        """Paused: take num_steps steps (fewer if the requests run out), then stay paused; done after them."""
        result = Future()
        self.send(Advance(num_steps, result))
        return result

    @property
    def paused(self) -> bool:
        return self._paused

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

    def send(self, message: Message) -> None:
        with self._lock:
            if self._closed:
                raise EngineClosed("this LLM is closed; create a new numaserve.LLM to go on")
            self._inbox.put(message)

    # ---- the loop thread -------------------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            numba.set_num_threads(self.engine.num_threads)  # thread-local: this thread runs the kernels
            self.num_threads = numba.get_num_threads()
            self.hooks.started(self.engine)
        except BaseException as e:  # noqa: BLE001  (raised by the constructor)
            self._failure, self._closed = e, True
            self.engine.close()
            return
        finally:
            ready.set()
        try:
            self._serve()
        except Exception as e:  # noqa: BLE001  (a bug in the loop itself: answer everyone, then stop)
            self._crash(e)
        finally:
            self.engine.close()  # the loop's end: no step will run again (the other ranks' processes stop)

    def _serve(self) -> None:
        while True:
            # before the first wait too: a report is due at once
            self._tick_s = self.hooks.tick(self.engine, self.post)
            if not self._drain(self._wait_s()):
                return
            if self._steps():
                self._step()
            elif expired := self.engine.abort_expired():  # a pause or a disk read holds no one past it
                self.hooks.ended(expired)
                self._deliver(expired)

    def _steps(self) -> bool:
        return (self.engine.has_unfinished() and not self.engine.waits_on_disk()
                and (not self._paused or self._advancing is not None))

    def _wait_s(self) -> float | None:
        """How long to sleep on the inbox: not at all while there are steps to take; else until the next
        tick, or a paused request's deadline check; None: until a message comes."""
        if self._steps():
            return 0.0
        # (waiting on disk: a read's end wakes it; the deadlines of those waiting are checked meanwhile)
        paused_s = IDLE_WAIT_S if self.engine.has_unfinished() else None
        waits = [s for s in (self._tick_s, paused_s) if s is not None]
        return min(waits) if waits else None

    def _drain(self, wait_s: float | None) -> bool:
        """Handle the queued messages, waiting up to wait_s for the first; -> False once told to stop."""
        try:
            message = self._inbox.get_nowait() if wait_s == 0.0 else self._inbox.get(timeout=wait_s)
            while True:
                if not self._handle(message):
                    return False
                message = self._inbox.get_nowait()
        except queue.Empty:
            return True

    def _handle(self, message: Message) -> bool:
        match message:
            case Submit():
                self._submit(message)
            case Abort(request_id):
                if request_id in self._outboxes and (out := self.engine.abort(request_id)) is not None:
                    self.hooks.ended([out])
                    self._deliver([out])
            case Call(fn, result):
                self._call(fn, result)
            case SetPaused(paused, result):
                self._paused = paused
                result.set_result(None)
            case Advance(num_steps, result):
                if not self._paused:
                    result.set_exception(InvalidRequest("advance() moves a paused worker; pause it first"))
                else:
                    self._advancing = (num_steps, result)
                    self._advanced(0)
            case Stop():
                self._fail(list(self._outboxes), EngineClosed("the LLM was closed before this request "
                                                              "finished"))
                return False
        return True

    def _submit(self, message: Submit) -> None:
        if message.prepare is not None:
            try:
                message.prepare(self.engine)
            except Exception as e:  # noqa: BLE001  (its requests fail with it)
                self.hooks.deliver([(outbox, RequestFailed(e)) for outbox in message.outboxes])
                return
        for req, outbox in zip(message.requests, message.outboxes):
            self._outboxes[req.request_id] = outbox
            if message.deltas:
                self._streamed.add(req.request_id)
            self.engine.submit(req)
        self.hooks.submitted(message.requests)

    def _call(self, fn: Callable, result: Future | None) -> None:
        try:
            value = fn(self.engine)
        except Exception as e:  # the caller gets it
            if result is None:
                log.exception("a posted call failed on the engine loop")
            else:
                result.set_exception(e)
            return
        if result is not None:
            result.set_result(value)

    def _step(self) -> None:
        start = time.perf_counter()
        try:
            step = self.engine.step()
        except Exception as e:  # noqa: BLE001  (a bug fails the requests it hit, not the loop)
            if isinstance(e, RankLost):
                self.hooks.fatal(e)
            held = [r.request_id for r in self.engine.scheduler.running if r.request_id in self._outboxes]
            self._fail(held or list(self._outboxes), self.hooks.failure(e))
            self._advanced()
            return
        self.hooks.stepped(step, start)
        self._deliver(step.outputs)
        self._advanced()

    def _advanced(self, num_steps: int = 1) -> None:
        """Count steps taken while advancing a paused loop; answer once they are all taken (or no request is
        left)."""
        if self._advancing is None:
            return
        left, result = self._advancing[0] - num_steps, self._advancing[1]
        self._advancing = (left, result)
        if left <= 0 or not self.engine.has_unfinished():
            self._advancing = None
            result.set_result(None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            if out.finished:
                self._streamed.discard(out.request_id)
                outbox = self._outboxes.pop(out.request_id, None)
            else:
                outbox = self._outboxes.get(out.request_id) if out.request_id in self._streamed else None
            if outbox is not None:
                items.append((outbox, out))
        if items:
            self.hooks.deliver(items)

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            self.engine.abort(request_id)
            self._streamed.discard(request_id)
        self.hooks.deliver([(self._outboxes.pop(request_id), RequestFailed(error))
                            for request_id in request_ids])

    def _crash(self, error: Exception) -> None:
        """Close, and fail every pending request and queued message with EngineClosed."""
        with self._lock:
            self._closed = True  # nothing but aborts is queued from here on
        failure = EngineClosed(f"the engine's loop failed ({error!r}); create a new numaserve.LLM to go on")
        outboxes = list(self._outboxes.values())
        self._outboxes.clear()
        self._streamed.clear()
        if self._advancing is not None:
            self._advancing[1].set_exception(failure)
        try:
            while True:
                match self._inbox.get_nowait():
                    case Submit(_, queued):
                        outboxes += queued
                    case Call(_, result) | SetPaused(_, result) | Advance(_, result) if result is not None:
                        result.set_exception(failure)
        except queue.Empty:
            pass
        self.hooks.deliver([(outbox, RequestFailed(failure)) for outbox in outboxes])
