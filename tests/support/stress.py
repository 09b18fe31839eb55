"""The suite's stress mode, for the tests marked `load_sensitive` (their outcome once depended on this
machine's speed, load or scheduling order, and is now fixed by construction; see the README's "Tests"):

    .venv/bin/pytest -m load_sensitive --stress-repeat 10               # each 10 times in a row
    .venv/bin/pytest -m load_sensitive --stress-repeat 10 --stress-burn # the same under a CPU burner

--stress-repeat N runs each marked test N times (as N parametrized rounds, consecutive); --stress-burn starts
one busy process per usable core for the whole session, at the tests' own priority. The hooks are imported by
tests/conftest.py."""

import os
import subprocess
import sys

import pytest

BURNER = "while True: pass"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("stress", "numaserve's stress mode (tests marked load_sensitive)")
    group.addoption("--stress-repeat", type=int, default=1, metavar="N",
                    help="run each test marked load_sensitive N times in a row")
    group.addoption("--stress-burn", action="store_true",
                    help="keep every usable core busy with a spinning process for the whole session")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "load_sensitive: its outcome once depended on the machine's speed or "
                                       "load; repeated by --stress-repeat")
    if config.getoption("stress_repeat") < 1:
        raise pytest.UsageError("--stress-repeat must be at least 1")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    rounds = metafunc.config.getoption("stress_repeat")
    if rounds > 1 and metafunc.definition.get_closest_marker("load_sensitive"):
        metafunc.fixturenames.append("stress_round")
        metafunc.parametrize("stress_round", range(rounds), ids=lambda i: f"round{i}")


@pytest.fixture(scope="session", autouse=True)
def cpu_burner(request):
    """With --stress-burn: one spinning process per core this process may use, until the session ends."""
    if not request.config.getoption("stress_burn"):
        yield []
        return
    burners = [subprocess.Popen([sys.executable, "-c", BURNER]) for _ in os.sched_getaffinity(0)]
    yield burners
    for burner in burners:
        burner.kill()
        burner.wait()
