"""actors/ray_instance.find_address: which Ray cluster `serve` joins, decided without ray.init (which hangs
on a dead GCS), and without starting Ray."""

import logging
import socket
import time

import pytest

from actors.ray_instance import PROBE_TIMEOUT_S, RayAddressError, find_address


@pytest.fixture
def record(tmp_path, monkeypatch):
    """Ray's address record (ray_current_cluster) in a temp dir of the test's own."""
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    return tmp_path / "ray" / "ray_current_cluster"


@pytest.fixture
def listener():
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def dead_address():
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    return f"127.0.0.1:{port}"  # closed: connections are refused


def test_no_record_and_no_address_start_a_local_instance(record):
    assert find_address(None) is None


def test_a_live_record_is_joined_as_ray_finds_it(record, listener):
    record.write_text(listener + "\n")
    assert find_address(None) == "auto"
    assert record.exists()


def test_a_stale_record_is_removed_with_a_warning_and_a_local_instance_started(record, dead_address, caplog):
    record.write_text(dead_address)
    with caplog.at_level(logging.WARNING, logger="numaserve"):
        assert find_address(None) is None
    assert not record.exists()
    assert f"names {dead_address}, where no Ray cluster answers" in caplog.text


@pytest.mark.parametrize("how", ["--address", "RAY_ADDRESS"])
def test_a_dead_address_asked_for_is_an_error_naming_the_fix(record, dead_address, monkeypatch, how):
    record.write_text(dead_address)  # never consulted when an address is asked for
    if how == "RAY_ADDRESS":
        monkeypatch.setenv("RAY_ADDRESS", dead_address)
    start = time.monotonic()
    with pytest.raises(RayAddressError) as error:
        find_address(dead_address if how == "--address" else None)
    assert f"no Ray cluster answers at {dead_address} ({how})" in str(error.value)
    assert time.monotonic() - start < PROBE_TIMEOUT_S + 1
    assert "ray start --head" in str(error.value) and f"leave {how} unset" in str(error.value)
    assert record.exists()


def test_the_address_flag_wins_over_ray_address_and_local_starts_anew(record, listener, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert find_address(listener) == listener
    record.write_text(listener)
    assert find_address("local") is None
