"""Request deadlines in the in-process engine, and the limit settings' validation (issue #14, part A)."""

import time

import pytest
from pydantic import ValidationError

from cluster_configs.cluster_config import HttpConfig
from cluster_configs.engine_config import EngineConfig
from cluster_configs.sampling_params import SamplingParams
from scheduling.engine import Engine
from tests.conftest import random_prompt

LONG = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(llama_dir):
    return Engine(llama_dir, EngineConfig(max_num_seqs=1, max_model_len=256, num_threads=1))


def _run_until(engine: Engine, req) -> list:
    outputs = []
    while not req.finished:
        outputs += [o for o in engine.step().outputs if o.request_id == req.request_id]
    return outputs


class Clock:
    """The clock the engine reads deadlines with, moved by the test alone (whatever this machine's speed)."""

    def __init__(self, monkeypatch):
        self.now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: self.now)


@pytest.mark.load_sensitive
def test_running_request_past_its_deadline_is_aborted_and_frees_its_blocks(engine, monkeypatch):
    clock = Clock(monkeypatch)
    req = engine.add_request("running", random_prompt(20, 1), LONG.model_copy(update={"deadline_s": 5.0}))
    while len(req.output_token_ids) < 3:
        engine.step()
    clock.now += 10.0
    outputs = _run_until(engine, req)
    assert req.finish_reason == "abort" and outputs[-1].finish_reason == "abort"
    assert 3 <= len(req.output_token_ids) < LONG.max_tokens  # it ran, then the deadline cut it
    assert not engine.has_unfinished()
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


@pytest.mark.load_sensitive
def test_waiting_request_past_its_deadline_is_aborted_without_running(engine, monkeypatch):
    clock = Clock(monkeypatch)
    first = engine.add_request("first", random_prompt(20, 2), LONG)
    second = engine.add_request("second", random_prompt(20, 3), LONG.model_copy(update={"deadline_s": 5.0}))
    engine.step()  # max_num_seqs=1: the first runs, the second waits
    clock.now += 10.0
    outputs = _run_until(engine, second)
    assert outputs[-1].finish_reason == "abort" and outputs[-1].token_ids == []
    assert not first.finished and second.num_computed_tokens == 0  # it never left the queue
    engine.abort("first")
    assert engine.stats()["num_free_blocks"] == engine.stats()["num_blocks"]


def test_request_within_its_deadline_finishes_normally(engine):
    req = engine.add_request("in-time", random_prompt(20, 4),
                             SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, deadline_s=600))
    _run_until(engine, req)
    assert req.finish_reason == "length" and len(req.output_token_ids) == 4


@pytest.mark.parametrize("value", [0, -1.0, 1e9])
def test_bad_deadline_is_refused_naming_the_field(value):
    with pytest.raises(ValidationError, match="deadline_s"):
        SamplingParams(deadline_s=value)


@pytest.mark.parametrize("field,value", [
    ("max_prompt_tokens", 0), ("max_tokens_cap", 0), ("max_concurrent_per_client", 0),
    ("default_deadline_s", 0.0), ("api_keys", ("",)), ("api_keys", ("a", "a")), ("api_keys", ("ab cd",)),
])
def test_bad_http_limit_is_refused_naming_the_field(field, value):
    with pytest.raises(ValidationError, match=field):
        HttpConfig(**{field: value})
