"""CallerChannel (actors/caller_channel.py): a caller's deltas on a worker, one batch per release, each
request's deltas merged in order; a request's first delta and its end are never held, the rest wait out the
hold; the channel ends only when closed (at once, nothing more sent) or idle with no request running."""

import asyncio

from actors.caller_channel import CallerChannel, merge
from scheduling.outputs import RequestOutput


def out(request_id: str, token: int, finish: str | None = None) -> RequestOutput:
    return RequestOutput(request_id, [token], str(token), finish)


def test_merge_joins_deltas_and_keeps_the_last_finish_reason():
    merged = merge("r", [RequestOutput("r", [1], "a"), RequestOutput("r", [2, 3], "bc", "length")])
    assert merged == RequestOutput("r", [1, 2, 3], "abc", "length")
    with_logprobs = merge("r", [RequestOutput("r", [1], "a", None, [{1: -0.5}]),
                                RequestOutput("r", [2, 3], "bc", "length", [{2: -0.1}, {3: -0.2, 4: -0.3}])])
    assert with_logprobs.logprobs == [{1: -0.5}, {2: -0.1}, {3: -0.2, 4: -0.3}]


def test_one_batch_carries_every_request_and_each_requests_deltas_in_order():
    async def scenario():
        channel = CallerChannel(asyncio.get_running_loop())
        for request_id in ("a", "b", "c"):
            channel.opened(request_id)
        for token in range(3):
            for request_id in ("a", "b", "c"):
                channel.put(request_id, out(request_id, token))
        batch = await channel.take()
        assert batch == [(r, RequestOutput(r, [0, 1, 2], "012")) for r in ("a", "b", "c")]
        assert channel.pending == {} and channel.num_running == 3
    asyncio.run(scenario())


def test_a_hold_delays_deltas_but_never_a_requests_first_delta_or_its_end():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = CallerChannel(loop)
        channel.opened("a")
        channel.put("a", out("a", 0))
        assert await channel.take() == [("a", out("a", 0))]
        channel.hold(0.2)
        start = loop.time()
        for i in range(3):
            loop.call_later(0.01 * (i + 1), channel.put, "a", out("a", i + 1))
        assert await channel.take() == [("a", RequestOutput("a", [1, 2, 3], "123"))]
        assert loop.time() - start >= 0.19  # held the full interval
        channel.hold(5.0)
        channel.opened("b")  # a new request's first delta goes at once, with what the others have
        loop.call_later(0.01, channel.put, "a", out("a", 4))
        loop.call_later(0.02, channel.put, "b", out("b", 0))
        start = loop.time()
        assert await channel.take() == [("a", out("a", 4)), ("b", out("b", 0))]
        channel.hold(5.0)
        loop.call_later(0.01, channel.put, "b", out("b", 1))  # held back ...
        loop.call_later(0.02, channel.put, "a", out("a", 5, "stop"))  # ... until a request ends
        assert await channel.take() == [("b", out("b", 1)), ("a", out("a", 5, "stop"))]
        assert loop.time() - start < 4.0 and channel.num_running == 1
    asyncio.run(scenario())


def test_a_failure_is_sent_alone_and_ends_its_request():
    async def scenario():
        channel = CallerChannel(asyncio.get_running_loop())
        channel.opened("a")
        error = RuntimeError("engine step failed")
        channel.put("a", out("a", 0))
        channel.put("a", error)
        assert await channel.take() == [("a", error)] and channel.num_running == 0
    asyncio.run(scenario())


def test_the_channel_idles_out_only_with_no_request_running():
    async def scenario():
        loop = asyncio.get_running_loop()
        channel = CallerChannel(loop, idle_s=0.05)
        channel.opened("a")
        loop.call_later(0.3, channel.put, "a", out("a", 0, "length"))  # runs past several idle_s
        assert await channel.take() == [("a", out("a", 0, "length"))]
        assert await channel.take() is None  # nothing running for idle_s
        channel.opened("b")
        channel.forget("b")  # its submission failed: it never runs
        assert channel.num_running == 0 and await channel.take() is None
    asyncio.run(scenario())


def test_a_closed_channel_ends_at_once_and_drops_what_was_pending_and_what_comes_after():
    async def scenario():
        channel = CallerChannel(asyncio.get_running_loop())
        for request_id in ("a", "b"):
            channel.opened(request_id)
        channel.put("a", out("a", 0))  # not yet taken: the caller is gone
        channel.close()
        assert await channel.take() is None
        channel.put("a", out("a", 1, "abort"))  # the aborts' outputs: nobody reads them
        assert await channel.take() is None and channel.pending == {}
    asyncio.run(scenario())
