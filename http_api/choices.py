"""The choices of one OpenAI request, each one deployment request: opened together, then streamed as SSE
data or collected into one answer (http_api/serving.py builds the bodies).

Each choice is opened before any answer goes out: admitted and its first output back, so a refusal
(Overloaded, a prompt too long, ...) is an HTTP error rather than a broken stream. Every exit path cancels
every stream still running, which aborts it on its worker and frees its KV blocks at once.
"""

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Protocol

from cluster_configs.errors import InvalidRequest
from http_api.errors import APIError, as_api_error, invalid_request
from http_api.limits import Tenancy
from http_api.protocol import MAX_CHOICES
from http_api.responses import ChoiceState, ResponseHeader, sse_event, usage
from scheduling.outputs import RequestOutput
from scheduling.sampling.best_of import best


class RequestStream(Protocol):
    async def next(self) -> list[int] | RequestOutput: ...  # the prompt's token ids first, then outputs
    def cancel(self) -> None: ...  # abort the request unless it has finished


async def open_choices(streams: list[RequestStream], tenancy: Tenancy, prompt_param: str,
                       deadline_s: float | None = None, constraint_param: str | None = None
                       ) -> tuple[list[ChoiceState], list[RequestOutput]]:
    """Wait until every choice's request is admitted and has its first output (a request aborted by its
    deadline before then is an error: nothing has been sent); on any failure every stream is cancelled. An
    invalid constraint is a 400 naming the request field that set it (constraint_param)."""
    try:
        prompt_ids = await asyncio.gather(*(s.next() for s in streams))
        for ids in prompt_ids:
            tenancy.check_prompt(len(ids), prompt_param)
        firsts = await asyncio.gather(*(s.next() for s in streams))
        if any(f.finish_reason == "abort" for f in firsts):
            raise tenancy.deadline_error(deadline_s)
    except InvalidRequest as e:  # the caller's or the engine's validation (scheduling/validation.py)
        for s in streams:
            s.cancel()
        message = str(e)
        # chat: the prompt is the rendered messages
        param = prompt_param if e.param == "prompt" else e.param
        if param == "structured_outputs" and constraint_param is not None:
            param = constraint_param
            if constraint_param != "structured_outputs":
                message = f"{constraint_param}: {message}"
        raise invalid_request(message, param) from None
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return [ChoiceState(i, ids) for i, ids in enumerate(prompt_ids)], firsts


async def sse_stream(header: ResponseHeader, choices: list[ChoiceState], streams: list[RequestStream],
                     firsts: list[RequestOutput], delta: Callable, opening: list[dict],
                     req) -> AsyncIterator[bytes]:
    """The SSE events of a stream: each choice's deltas as they come, finish_reason on its last chunk, the
    usage chunk if asked, [DONE]. A client that goes away cancels this generator: every request is
    aborted."""
    queue: asyncio.Queue = asyncio.Queue()
    tasks: list[asyncio.Task] = []
    extra = {"usage": None} if req.include_usage else {}
    try:
        for chunk in opening:
            yield _event(header.body([chunk], **extra))
        for i, first in enumerate(firsts):
            queue.put_nowait((i, first))
            if not first.finished:
                tasks.append(asyncio.create_task(_pump(i, streams[i], queue)))
        num_running = len(choices)
        while num_running:
            i, out = await queue.get()
            if isinstance(out, Exception):
                raise out
            chunk = delta(choices[i], out)
            choices[i].add(out)
            if chunk is not None:
                yield _event(header.body([chunk], **extra))
            num_running -= out.finished
        if req.include_usage:
            yield _event(header.body([], usage=usage(choices, req.n)))
    except Exception as e:  # noqa: BLE001  (after the 200 an error can only go into the stream)
        yield _event(as_api_error(e).sse_data())
    finally:  # no await here: a cancelled generator cannot
        for t in tasks:
            t.cancel()
        for s in streams:
            s.cancel()
    yield sse_event("[DONE]")


async def _pump(i: int, stream: RequestStream, queue: asyncio.Queue) -> None:
    try:
        while not (out := await stream.next()).finished:
            queue.put_nowait((i, out))
        queue.put_nowait((i, out))
    except Exception as e:  # noqa: BLE001  (handed to the stream's consumer)
        queue.put_nowait((i, e))


async def collect(choices: list[ChoiceState], streams: list[RequestStream],
                  firsts: list[RequestOutput]) -> None:
    """Every choice's outputs added to it until it finishes; the streams are cancelled on the way out."""
    async def drain(c: ChoiceState, stream: RequestStream, first: RequestOutput) -> None:
        c.add(first)
        while c.finish_reason is None:
            c.add(await stream.next())

    try:
        await asyncio.gather(*(drain(c, s, f) for c, s, f in zip(choices, streams, firsts)))
    finally:
        for s in streams:
            s.cancel()


def best_choices(choices: list[ChoiceState], n: int, best_of: int) -> list[ChoiceState]:
    """Of each prompt's best_of candidates (consecutive), the n best (scheduling/sampling/best_of.py), indexed
    as choices 0, 1, ... in that order."""
    kept = []
    for first in range(0, len(choices), best_of):
        group = choices[first:first + best_of]
        kept += [group[i] for i in best(n, [(c.token_ids, c.logprobs) for c in group])]
    return [replace(c, index=i) for i, c in enumerate(kept)]


def check_num_choices(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_CHOICES:
        raise APIError(400, f"{num_prompts} prompts x n={n} asks for {num_prompts * n} completions; at most "
                            f"{MAX_CHOICES} per request: send fewer prompts or a smaller n", param="n")


def _event(body: dict) -> bytes:
    return sse_event(json.dumps(body, ensure_ascii=False, separators=(",", ":")))
