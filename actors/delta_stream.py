"""A request's deltas on a worker's event loop, coalesced into chunks for its Ray stream."""

import asyncio

from scheduling.outputs import RequestOutput


def merge(request_id: str, outputs: list[RequestOutput]) -> RequestOutput:
    """Several deltas of one request that are ready together, as one."""
    logprobs = None if outputs[0].logprobs is None else [lp for o in outputs for lp in o.logprobs]
    prompt_logprobs = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    token_ids, text = [t for o in outputs for t in o.token_ids], "".join(o.text for o in outputs)
    return RequestOutput(request_id, token_ids, text, outputs[-1].finish_reason, logprobs, prompt_logprobs)


class DeltaStream:
    """One request's deltas on the actor's event loop, released as a chunk when the hold after the previous
    chunk has passed, or at once when the request ends (one timer per chunk, not per token)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list[RequestOutput | Exception] = []
        self.ready = asyncio.Event()
        self.hold_until = 0.0

    def put(self, item: RequestOutput | Exception) -> None:
        self.items.append(item)
        if isinstance(item, Exception) or item.finished or self.loop.time() >= self.hold_until:
            self.ready.set()

    def hold(self, seconds: float) -> None:
        if seconds > 0:
            self.hold_until = self.loop.time() + seconds
            self.loop.call_at(self.hold_until, self._release)

    def _release(self) -> None:
        if self.items:
            self.ready.set()

    async def take(self) -> list[RequestOutput | Exception]:
        await self.ready.wait()
        self.ready.clear()
        items, self.items = self.items, []
        return items
