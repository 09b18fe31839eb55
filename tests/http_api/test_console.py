"""The web console's server side, without a browser (tests/cluster/test_console.py drives the pages in
Chromium): its files are served and reference only files that are, GET /v1/numaserve/stats answers typed
records that match the engine, behind the API key like the other /v1 routes, and --no-ui serves no page."""

import re

import pytest
import requests

import numaserve as ns
from http_api.app import CONSOLE, build_app
from http_api.console_stats import ConsoleStats, console_stats
from tests.http_api.test_http_openai import serving_of
from tests.support.http_app import served
from tests.support.model_factory import build_model

KEY = "console-key"
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def llm(module_llm, tmp_path_factory):
    directory = tmp_path_factory.mktemp("console") / "llama"
    build_model(directory, "llama")
    return module_llm(directory, num_threads=1)


@pytest.fixture(scope="module")
def url(llm):
    with served(build_app(serving_of(llm))) as url:
        yield url


def test_the_page_and_every_file_it_and_its_modules_name_are_served(url):
    page = requests.get(f"{url}/", timeout=TIMEOUT_S)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    named = set(re.findall(r'(?:src|href)="(/console/[^"]+)"', page.text))
    assert {"/console/main.js", "/console/console.css"} <= named
    for module in CONSOLE.glob("*.js"):  # ES module imports: "./x.js"
        named |= {f"/console/{m}" for m in re.findall(r'from "\./([^"]+)"', module.read_text())}
    for path in sorted(named):
        r = requests.get(url + path, timeout=TIMEOUT_S)
        assert r.status_code == 200, path
        if path.endswith(".js"):  # a module script is refused by the browser under another type
            assert r.headers["content-type"].startswith("text/javascript"), path
    shipped = {f"/console/{p.name}" for p in CONSOLE.iterdir()} - {"/console/index.html"}
    assert shipped <= named, "files shipped that nothing loads"


def test_stats_are_typed_records_that_match_the_engine(url, llm):
    llm.generate(["one", "two"], ns.SamplingParams(max_tokens=5, ignore_eos=True))
    r = requests.get(f"{url}/v1/numaserve/stats", timeout=TIMEOUT_S)
    assert r.status_code == 200
    stats = ConsoleStats.model_validate(r.json())
    [worker] = stats.workers
    engine = llm.stats()
    assert (worker.worker_id, worker.alive, worker.error, stats.model) == ("local", True, None, "tiny")
    e = worker.engine
    assert e.num_generated_tokens == engine["num_generated_tokens"] >= 10
    assert (e.num_running, e.num_waiting, e.kv_used_blocks) == (0, 0, 0)
    assert e.kv_total_blocks == engine["num_blocks"] and e.spec_method == "off" and e.spec_acceptance is None
    assert e.tokens_per_s >= 0 and 0 < e.window_s and e.tensor_parallel_size == 1
    assert e.cpu_seconds is None  # no worker process measured in process


def test_a_down_worker_and_an_unanswering_router_are_records_with_the_time_they_were_gathered():
    stats = console_stats("m", {"time": 1234.5, "workers": {"w1": {"alive": False,
                                                                  "num_outstanding_requests": 0}},
                                "routed": {"w1": 3}})
    [w] = stats.workers
    assert (w.alive, w.engine, w.error, stats.num_routed) == (False, None, "down", 3)
    assert stats.time == 1234.5  # when the router gathered it: a copy served twice keeps it
    stats = console_stats("m", {"error": "no router answered"})
    assert (stats.workers, stats.error) == ([], "no router answered")


@pytest.fixture(scope="module")
def keyed_url(llm):
    with served(build_app(serving_of(llm, api_keys=(KEY,)))) as url:
        yield url


def test_with_an_api_key_the_stats_need_it_and_the_page_learns_so_without_a_401(keyed_url):
    r = requests.get(f"{keyed_url}/v1/numaserve/stats", timeout=TIMEOUT_S)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    auth = requests.get(f"{keyed_url}/console/auth", timeout=TIMEOUT_S)
    assert auth.status_code == 200 and auth.json() == {"key_required": True, "authorized": False}
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert requests.get(f"{keyed_url}/console/auth", headers=bearer, timeout=TIMEOUT_S).json() == {
        "key_required": True, "authorized": True}
    r = requests.get(f"{keyed_url}/v1/numaserve/stats", headers=bearer, timeout=TIMEOUT_S)
    assert r.status_code == 200


def test_no_ui_serves_no_page(llm):
    with served(build_app(serving_of(llm, ui=False))) as url:
        assert requests.get(f"{url}/", timeout=TIMEOUT_S).status_code == 404
        assert requests.get(f"{url}/console/main.js", timeout=TIMEOUT_S).status_code == 404
        # the API stays
        assert requests.get(f"{url}/v1/numaserve/stats", timeout=TIMEOUT_S).status_code == 200
