"""The web console in headless Chromium against a real `numaserve serve` (Ray, two simulated NUMA workers, an
API key): without the key the page shows the key field and no data; a chat reply streams into the page a step
at a time and equals the API's greedy answer; stop aborts a reply and the workers' KV returns to idle; the
live view shows both workers and their tokens/s rising with requests; no console errors. The screenshots in
docs/images are the ones these tests take. Also: /metrics carries the stage histograms and CPU counters with
the NUMA node label, and every query of the Grafana dashboard in docs/ names a metric the server exports."""

import itertools
import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import numaserve as ns
from benchmarks.ports import free_port
from numaserve.cli import main
from scheduling.step_stats import STAGES
from tests.cluster.conftest import CONFIGS, advance, idle, paused, queued, scrape, wait_for
from tests.support.browser import WatchedPage, chromium

NAME = "console"
KEY = "console-test-key"
MODEL = "llama"
PROMPT = "def add(a, b):"
DOCS = Path(__file__).resolve().parents[2] / "docs"
IMAGES = DOCS / "images"
WORKERS = ["local-numa0-0", "local-numa1-0"]
UI_TIMEOUT_MS = 30_000  # generous: a loaded machine renders in well under a second
STEP_TEXT_TIMEOUT_S = 2.0  # a step whose token completes no character shows nothing new: move on after this

# every text the assistant's reply shows, in order, as the page renders it (one entry per change)
OBSERVE_REPLY = """() => {
  window.seen = [];
  new MutationObserver(() => {
    const reply = document.querySelector(".msg.assistant .content");
    const text = reply ? reply.textContent : "";
    if (text && text !== window.seen[window.seen.length - 1]) window.seen.push(text);
  }).observe(document.getElementById("messages"), {subtree: true, childList: true, characterData: true});
}"""


@pytest.fixture(scope="module")
def url(ray_cluster, llama_dir):
    port = free_port()
    assert main(["serve", "--config", str(CONFIGS / "two_numa_sim.yaml"), "--model", str(llama_dir),
                 "--name", NAME, "--http-port", str(port), "--api-key", KEY, "--detach"]) == 0
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        assert main(["shutdown", "--name", NAME]) == 0


@pytest.fixture(scope="module")
def client(url):
    return ns.connect(NAME)


@pytest.fixture(scope="module")
def api(url) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def browser():
    with chromium() as browser:
        yield browser


@pytest.fixture
def watched(browser):
    page = WatchedPage(browser)
    yield page
    page.close()
    assert not page.errors, f"the browser's console showed errors: {page.errors}"


def open_console(watched: WatchedPage, url: str, page: str = "chat", key: str | None = KEY):
    p = watched.page
    p.goto(f"{url}/#{page}")
    if key is not None:
        p.fill("#api-key", key)
        p.click("#key-form button")
        p.wait_for_selector(f"#{page}:not([hidden])", timeout=UI_TIMEOUT_MS)
    return p


def set_sampling(p, temperature: float, max_tokens: int) -> None:
    p.wait_for_selector("#model option", state="attached", timeout=UI_TIMEOUT_MS)
    p.fill("#temperature", str(temperature))
    p.fill("#max-tokens", str(max_tokens))


def step_until(p, client, done_selector: str, max_steps: int) -> None:
    """Paused workers take one step at a time, each once the page has shown the text of the one before (or
    a step has shown none), until done_selector is in the page: every token arrives in a chunk of its own."""
    for _ in range(max_steps):
        if p.locator(done_selector).count():
            return
        shown = p.evaluate("window.seen.length")
        advance(client)
        deadline = time.monotonic() + STEP_TEXT_TIMEOUT_S
        while time.monotonic() < deadline and p.evaluate("window.seen.length") == shown \
                and not p.locator(done_selector).count():
            time.sleep(0.02)
    raise AssertionError(f"{done_selector} not shown after {max_steps} steps")


def test_without_the_key_the_page_shows_the_key_field_and_no_data(url, watched):
    p = open_console(watched, url, key=None)
    p.wait_for_selector("#key-needed:not([hidden])", timeout=UI_TIMEOUT_MS)
    assert p.is_visible("#api-key")
    assert p.is_hidden("#chat") and p.is_hidden("#live")
    assert p.locator("#model option").count() == 0 and p.locator(".worker-card").count() == 0
    p.goto(f"{url}/#live")  # the live view asks for nothing either
    p.wait_for_selector("#key-needed:not([hidden])", timeout=UI_TIMEOUT_MS)
    time.sleep(1.5)  # a poll period: no stats were asked for
    assert p.locator(".worker-card").count() == 0
    p.screenshot(path=str(IMAGES / "console-key.png"))


def test_a_reply_streams_into_the_page_token_by_token_and_equals_the_apis_greedy_answer(url, watched, client,
                                                                                        api):
    wait_for(lambda: idle(client), 30, "an idle deployment")
    p = open_console(watched, url)
    set_sampling(p, temperature=0, max_tokens=12)
    p.evaluate(OBSERVE_REPLY)
    with paused(client):
        p.fill("#prompt", PROMPT)
        p.click("#send")
        wait_for(lambda: queued(client) == 1, 30, "the page's request to reach a worker")
        step_until(p, client, ".msg.assistant.done", max_steps=40)
    seen = p.evaluate("window.seen")
    text = p.text_content(".msg.assistant .content")
    expected = api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                           temperature=0, max_tokens=12).choices[0]
    assert expected.finish_reason == "length"  # 12 tokens, no EOS: the stop test's reply runs on too
    assert text == expected.message.content
    assert len(seen) >= 3 and seen[-1] == text, seen
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(seen)), seen
    assert re.fullmatch(r"12 tokens · TTFT \d+ ms · [\d.]+ tokens/s", p.text_content(".msg.assistant .meta"))
    # a second turn, the workers running freely (its times are the screenshot's)
    set_sampling(p, temperature=0.7, max_tokens=48)
    p.fill("#prompt", "and then?")
    p.click("#send")
    p.wait_for_selector(".msg.assistant.done >> nth=1", timeout=UI_TIMEOUT_MS)
    assert p.locator(".msg.user").count() == 2
    p.screenshot(path=str(IMAGES / "console-chat.png"))


def test_a_json_schema_constrains_the_reply_and_a_schema_that_does_not_parse_sends_nothing(url, watched,
                                                                                        client):
    p = open_console(watched, url)
    set_sampling(p, temperature=1.0, max_tokens=64)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    p.fill("#schema", json.dumps(schema))
    p.fill("#prompt", "Is it?")
    p.click("#send")
    p.wait_for_selector(".msg.assistant.done", timeout=UI_TIMEOUT_MS)
    reply = json.loads(p.text_content(".msg.assistant .content"))
    assert set(reply) == {"ok"} and isinstance(reply["ok"], bool)
    routed = sum(client.stats()["routed"].values())
    p.fill("#schema", "{not json")
    p.fill("#prompt", "Again?")
    p.click("#send")
    p.wait_for_selector(".msg.assistant.error", timeout=UI_TIMEOUT_MS)
    assert "the JSON schema does not parse" in p.text_content(".msg.assistant.error .meta")
    assert sum(client.stats()["routed"].values()) == routed  # nothing was sent
    assert p.input_value("#prompt") == "Again?"  # the message is not lost


def test_stop_aborts_a_long_reply_and_the_workers_kv_returns_to_idle(url, watched, client):
    wait_for(lambda: idle(client), 30, "an idle deployment")
    p = open_console(watched, url)
    set_sampling(p, temperature=0, max_tokens=4000)
    p.evaluate(OBSERVE_REPLY)
    before = sum(w["num_generated_tokens"] for w in client.stats()["workers"].values())
    with paused(client):
        p.fill("#prompt", PROMPT)
        p.click("#send")
        wait_for(lambda: queued(client) == 1, 30, "the page's request to reach a worker")
        for _ in range(3):
            advance(client)
        p.wait_for_function("window.seen.length > 0", timeout=UI_TIMEOUT_MS)
        assert p.is_enabled("#stop")
        p.click("#stop")
        p.wait_for_selector(".msg.assistant.stopped", timeout=UI_TIMEOUT_MS)
        # aborted on its worker while no step runs: it cannot have run on to its 4,000 tokens
        wait_for(lambda: idle(client), 30, "the stopped request to leave its worker and free its KV blocks")
    generated = sum(w["num_generated_tokens"] for w in client.stats()["workers"].values()) - before
    assert 1 <= generated <= 3
    assert p.is_enabled("#send") and p.is_disabled("#stop")
    assert "stopped" in p.text_content(".msg.assistant .meta")


def keep_busy(api, caller: int, stop: threading.Event) -> int:
    """Streamed completions one after another until stop is set -> how many finished."""
    num_done = 0
    while not stop.is_set():
        for _ in api.completions.create(model=MODEL, prompt=f"{PROMPT} {caller} {num_done}", max_tokens=64,
                                        stream=True, extra_body={"ignore_eos": True}):
            pass
        num_done += 1
    return num_done


def tokens_per_s(p) -> dict[str, float]:
    return {card.get_attribute("data-worker"): float(card.locator(".tokens-per-s .value").text_content())
            for card in p.locator(".worker-card").all()}


def test_the_live_view_shows_both_workers_and_their_tokens_per_s_rise_with_requests(url, watched, client,
                                                                                    api):
    wait_for(lambda: idle(client), 30, "an idle deployment")
    p = open_console(watched, url, page="live")
    p.wait_for_selector(".worker-card", timeout=UI_TIMEOUT_MS)
    assert sorted(tokens_per_s(p)) == WORKERS
    for worker in WORKERS:
        where = p.text_content(f'.worker-card[data-worker="{worker}"] .where')
        assert where.startswith(f"NUMA node {worker[len('local-numa')]} · cores "), where
    # the rates cover the last seconds: they fall to 0 once the earlier tests' steps are that old
    wait_for(lambda: set(tokens_per_s(p).values()) == {0.0}, 60, "the live view to show idle workers")
    stop = threading.Event()
    with ThreadPoolExecutor(4) as pool:  # 4 callers at once: the router spreads them over both workers
        load = [pool.submit(keep_busy, api, i, stop) for i in range(4)]
        try:
            wait_for(lambda: min(tokens_per_s(p).values()) > 0, 60, "both workers' tokens/s to rise")
            assert sorted(tokens_per_s(p)) == WORKERS
            p.wait_for_function("document.querySelectorAll('#chart-tokens polyline').length == 2",
                                timeout=UI_TIMEOUT_MS)
            time.sleep(5)  # a few more points on the charts for the screenshot
            p.screenshot(path=str(IMAGES / "console-live.png"), full_page=True)
        finally:
            stop.set()
        assert all(f.result() > 0 for f in load)
    wait_for(lambda: idle(client), 60, "the load to end")


def test_metrics_carry_stage_histograms_and_cpu_seconds_per_worker_with_its_numa_node(url, client, api):
    api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"ignore_eos": True})
    samples = scrape(url)
    for worker in WORKERS:
        node = worker[len("local-numa")]
        cpu = [s for s in samples if s.name == "numaserve:worker_cpu_seconds_total"
               and s.labels["worker"] == worker]
        assert len(cpu) == 1 and cpu[0].value > 0 and cpu[0].labels["numa_node"] == node
        counts = {s.labels["stage"]: s.value for s in samples
                  if s.name == "numaserve:step_stage_seconds_count" and s.labels["worker"] == worker}
        assert set(counts) == set(STAGES) and len(set(counts.values())) == 1  # every stage of every step
    steps = sum(w["num_steps"] for w in client.stats()["workers"].values())
    assert 0 < sum(s.value for s in samples if s.name == "numaserve:step_stage_seconds_count"
                   and s.labels["stage"] == "run") <= steps  # the steps that ran a batch, of all steps


def exported(url: str) -> set[str]:
    """Every series name /metrics declares, with or without samples yet (a counter's with _total, a
    histogram's _bucket, _sum and _count)."""
    text = requests.get(f"{url}/metrics", timeout=30).text
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + suffix for f in text_string_to_metric_families(text) for suffix in suffixes[f.type]}


def test_every_query_of_the_grafana_dashboard_names_a_metric_the_server_exports(url):
    exported_names = exported(url)
    dashboard = json.loads((DOCS / "grafana" / "numaserve-dashboard.json").read_text())
    queries = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    queries += [variable["definition"] for variable in dashboard["templating"]["list"]]
    assert queries
    named = set()
    for query in queries:
        names = set(re.findall(r"\b(?:numaserve:[a-z0-9_]+|http_requests_total)\b", query))
        assert names, query
        named |= names
    assert named <= exported_names, sorted(named - exported_names)
    assert {"numaserve:step_stage_seconds_bucket", "numaserve:worker_cpu_seconds_total"} <= named
