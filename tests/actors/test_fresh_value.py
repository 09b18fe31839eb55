"""FreshValue (actors/fresh_value.py), /health's serving-worker count: answered from memory while fresh, one
ask at a time in the background, never older than max_age_s. A fake clock and asks the test releases."""

import asyncio

from actors.fresh_value import FreshValue


async def settle() -> None:
    """Lets every ready task run (a get, the ask it starts, the ask's answer reaching the get)."""
    for _ in range(5):
        await asyncio.sleep(0)


class Asks:
    """Each ask waits until the test releases it with its answer."""

    def __init__(self):
        self.pending: list[asyncio.Future] = []

    async def __call__(self) -> int:
        answer = asyncio.get_running_loop().create_future()
        self.pending.append(answer)
        return await answer

    async def release(self, value: int) -> None:
        self.pending.pop(0).set_result(value)
        await settle()


def test_answers_from_memory_while_fresh_and_refreshes_once_in_the_background():
    async def run():
        now = [100.0]
        asks = Asks()
        value = FreshValue(asks, refresh_s=0.25, max_age_s=2.0, clock=lambda: now[0])
        first = asyncio.ensure_future(value.get())  # nothing known yet: waits for the first ask
        await settle()
        assert not first.done() and len(asks.pending) == 1
        await asks.release(2)
        assert await first == 2

        now[0] += 0.1  # fresh: no ask
        assert await value.get() == 2 and value.num_asks == 1 and not asks.pending

        now[0] += 0.2  # stale: the old answer at once, one ask started, however many calls
        assert [await value.get() for _ in range(5)] == [2] * 5
        await settle()
        assert value.num_asks == 2 and len(asks.pending) == 1
        await asks.release(1)
        assert await value.get() == 1 and value.num_asks == 2  # fresh again, as of the ask's start

        now[0] += 2.5  # too old to answer: waits for the ask it starts
        late = asyncio.ensure_future(value.get())
        await settle()
        assert not late.done() and value.num_asks == 3
        await asks.release(0)
        assert await late == 0

    asyncio.run(run())


def test_a_slow_ask_holds_no_answer_until_it_is_too_old():
    async def run():
        now = [0.0]
        asks = Asks()
        value = FreshValue(asks, refresh_s=0.25, max_age_s=2.0, clock=lambda: now[0])
        first = asyncio.ensure_future(value.get())
        await settle()
        await asks.release(3)
        await first
        now[0] = 1.0  # an ask starts and hangs
        assert await value.get() == 3
        now[0] = 1.9  # still under max_age_s: answered, no second ask
        assert await value.get() == 3 and value.num_asks == 2
        now[0] = 2.1  # the answer is too old: callers wait for the ask under way, none started beside it
        waiting = [asyncio.ensure_future(value.get()) for _ in range(3)]
        await settle()
        assert not any(w.done() for w in waiting) and value.num_asks == 2
        waiting[0].cancel()  # a caller gone does not cancel the ask the others wait for
        await settle()
        await asks.release(0)
        assert [await w for w in waiting[1:]] == [0, 0]

    asyncio.run(run())
