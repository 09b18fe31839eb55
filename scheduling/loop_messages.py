"""What crosses between an engine loop's callers and its thread (STYLE 16): one set of typed messages for
every front door (numaserve.LLM, its sessions, the worker actor)."""

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol

from scheduling.request import Request


class Outbox(Protocol):
    """Where a request's outputs go: a queue.SimpleQueue (a thread waits on it) or anything with put()."""

    def put(self, item) -> None: ...


@dataclass(frozen=True)
class Submit:
    requests: tuple[Request, ...]
    outboxes: tuple[Outbox, ...]  # one per request: its RequestOutputs, then nothing, or a RequestFailed
    # whether each step's delta goes to the outbox (a stream), or only the last (a caller that only waits
    # is not woken at every step)
    deltas: bool
    # run on the loop thread just before the requests are queued (a worker holds an adapter's weights, or
    # attaches a session sequence); if it raises, the requests fail with its exception
    prepare: Callable[[object], None] | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Call:
    """fn(engine), run on the loop thread between steps; its value or exception goes to result (None: nobody
    waits for it)."""

    fn: Callable[[object], object]
    result: Future | None


@dataclass(frozen=True)
class SetPaused:
    """A paused loop takes no step (its requests stay as they are) but goes on taking messages and ends the
    requests whose deadline passes."""

    paused: bool
    result: Future


@dataclass(frozen=True)
class Advance:
    """Paused: take num_steps steps (fewer if the requests run out), then answer."""

    num_steps: int
    result: Future


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class RequestFailed:
    """The last item in the outbox of a request that a failing step (or close()) ended."""

    error: Exception


Message = Submit | Abort | Call | SetPaused | Advance | Stop
