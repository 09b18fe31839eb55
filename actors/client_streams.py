"""ClientStreams: a client's requests (actors/request_stream.py, async) run on an event loop of its own, in
a daemon thread, for callers that wait on each delta in their own threads; a Client and its sessions share
one."""

import asyncio
import threading
from collections.abc import Iterator

from actors.request_stream import Ingress, RequestStream
from scheduling.outputs import Completion, RequestOutput


class _EventLoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="numaserve-client", daemon=True).start()

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()


class ClientStreams:
    def __init__(self, ingress: Ingress):
        self.ingress = ingress
        self._loop: _EventLoopThread | None = None  # started with the first request
        self._loop_lock = threading.Lock()

    def run(self, coroutine):
        """The coroutine run on the client's event loop; its value."""
        return self._event_loop().run(coroutine)

    def open(self, prompt, params, adapter, session, cache_salt, **placement) -> RequestStream:
        """A request admitted and placed (Ingress.open); its deltas come from deltas()."""
        return self.run(self.ingress.open(prompt, params, adapter, session, cache_salt, **placement))

    def deltas(self, stream: RequestStream) -> Iterator[RequestOutput]:
        """A stream's deltas, each awaited on the event loop; closing the iterator early aborts it."""
        loop = self._event_loop()
        try:
            while not stream.done:
                yield loop.run(stream.next())
        finally:
            if not stream.done:  # closed early: abort it
                loop.loop.call_soon_threadsafe(stream.cancel)

    def _event_loop(self) -> _EventLoopThread:
        with self._loop_lock:
            if self._loop is None:
                self._loop = _EventLoopThread()
            return self._loop


def complete(prompt_token_ids: list[int], chunks: Iterator[RequestOutput]) -> Completion:
    """A request's chunks folded into its Completion."""
    done = Completion(prompt_token_ids=prompt_token_ids)
    for chunk in chunks:
        done.token_ids += chunk.token_ids
        done.text += chunk.text
        done.finish_reason = chunk.finish_reason
        if chunk.logprobs is not None:
            done.logprobs = (done.logprobs or []) + chunk.logprobs
    return done
