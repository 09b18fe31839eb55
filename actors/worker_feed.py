"""A caller's feed from one worker: one Ray stream (NumaWorker.caller_stream) carries the deltas of all the
caller's requests there, read by one task and handed to each request's queue (the worker's side:
actors/caller_channel.py). So the caller's cost per engine step does not grow with its streams.

The worker ends the stream when the caller has had no request there for a while, or at once when it took
the caller for dead (its lease lapsed); the feed opens it again while it holds a request (one whose
submission is in flight, say), naming the requests it waits for: any the worker no longer runs for this
caller comes back CallerGone, and resumes elsewhere. A lost worker fails every request of the
feed with WorkerLost (each resumes elsewhere), and the feed is forgotten: a request placed on the worker once
it has restarted opens a new one.
"""

import asyncio
from collections.abc import Callable

from ray.exceptions import RayTaskError

from actors.caller_channel import Item
from actors.channel_wire import decode
from actors.ray_errors import WORKER_LOST, unwrap


class WorkerLost(Exception):
    """The last item of each request of a feed whose worker was lost."""


class WorkerFeed:
    def __init__(self, worker, caller_id: str, forget: Callable[["WorkerFeed"], None]):
        self.worker, self.caller_id, self._forget = worker, caller_id, forget
        self.queues: dict[str, asyncio.Queue[Item]] = {}  # request (attempt) id -> its items
        self.submitted: set[str] = set()  # of those, the ones whose submit returned: the worker runs them
        self._task: asyncio.Task | None = None

    def add(self, request_id: str) -> asyncio.Queue[Item]:
        """request_id's queue, before its submission (its first items may come before the submit returns)."""
        queue = self.queues[request_id] = asyncio.Queue()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._read())
        return queue

    def submitted_to(self, request_id: str) -> None:
        """The request's submit returned: a worker that reopens the stream and no longer runs it (restarted
        since, say) says so (CallerGone)."""
        if request_id in self.queues:
            self.submitted.add(request_id)

    def remove(self, request_id: str) -> None:
        """The request ended, was cancelled or moved: what else comes for it is dropped."""
        self.queues.pop(request_id, None)
        self.submitted.discard(request_id)

    async def _read(self) -> None:
        try:
            while self.queues:
                async for ref in self.worker.caller_stream.remote(self.caller_id, tuple(self.queues),
                                                                  tuple(self.submitted)):
                    for request_id, item in decode(await ref):
                        queue = self.queues.get(request_id)
                        if queue is not None:
                            queue.put_nowait(item)
        except WORKER_LOST as e:
            self._fail(WorkerLost(str(e)))
        except RayTaskError as e:  # a bug in caller_stream: its requests fail with it
            self._fail(unwrap(e, "worker"))
        except Exception as e:  # noqa: BLE001  (a batch that does not decode: the same)
            self._fail(e)
        finally:
            self._forget(self)

    def _fail(self, error: BaseException) -> None:
        for queue in self.queues.values():
            queue.put_nowait(error)
        self.queues.clear()
        self.submitted.clear()


class WorkerFeeds:
    """A caller's feeds, one per worker it has requests on."""

    def __init__(self, caller_id: str):
        self.caller_id = caller_id
        self.by_worker: dict[str, WorkerFeed] = {}

    def feed(self, worker_id: str, worker) -> WorkerFeed:
        feed = self.by_worker.get(worker_id)
        if feed is None:
            feed = self.by_worker[worker_id] = WorkerFeed(worker, self.caller_id,
                                                          lambda f: self._forget(worker_id, f))
        return feed

    def _forget(self, worker_id: str, feed: WorkerFeed) -> None:
        if self.by_worker.get(worker_id) is feed:
            del self.by_worker[worker_id]
