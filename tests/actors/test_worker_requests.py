"""RecentIds and settle (actors/worker_requests.py): an id is remembered until it is popped or keep_s has
passed, each pop answers once; an awaited request's future settles on its end, with its failure or its last
output, and only once."""

import asyncio

import pytest

from actors.worker_requests import RecentIds, settle
from scheduling.outputs import RequestOutput


def test_an_id_is_remembered_until_popped_or_kept_past_keep_s():
    ids = RecentIds(keep_s=10.0)
    ids.add("a", 0.0)
    ids.add("b", 5.0)
    assert ids.pop("a") and not ids.pop("a")  # once
    ids.add("a", 6.0)
    ids.add("c", 15.5)  # "b" (5.0) is past keep_s: forgotten; "a" (6.0) is not
    assert list(ids.added) == ["a", "c"]
    ids.add("a", 20.0)  # added again: its time is the new one, and it is the newest
    ids.add("d", 25.0)  # "c" (15.5) is kept, "a" (20.0) too
    assert list(ids.added) == ["c", "a", "d"] and not ids.pop("b")


def test_settle_ends_with_the_last_output_or_the_failure_once():
    async def scenario():
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        settle(done, RequestOutput("r", [1], "a"))
        assert not done.done()
        last = RequestOutput("r", [], "", "length")
        settle(done, last)
        settle(done, RuntimeError("after the end"))  # ignored
        assert done.result() is last
        failed = loop.create_future()
        settle(failed, RuntimeError("engine step failed"))
        with pytest.raises(RuntimeError, match="engine step failed"):
            failed.result()
    asyncio.run(scenario())
