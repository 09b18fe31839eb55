"""What the web console costs the streams it watches: bench_http's HTTP load with the live view polled, by a
headless Chromium on the same cores or by a minimal client, against the same load with no console.

    python -m benchmarks.bench_console [--concurrency 1,16] [--repeats 6] [--max-tokens 64]

One deployment as bench_http's "shared" layout (the TinyLlama-1.1B-shaped random checkpoint, q8_0, one worker
on every core, stream_interval_ms 0), driven over loopback by asyncio `openai` clients in this process. Each
sample runs max(2 x c, 4) requests (c streams in flight, unique random prompts per sample) in one of three
states, alternating sample by sample, the order rotating every repeat:
- closed: no console;
- polled: a minimal client process fetching /v1/numaserve/stats once a second over one kept-alive
  connection, what the live view asks of the server: the server's cost of a console whose browser runs
  elsewhere (an operator's own machine);
- browser: Debian's Chromium, headless, showing `/#live` on the same cores as everything else (its own CPU
  included: a browser on the serving machine itself).
Before a polled or browser sample starts, the server's own count of /v1/numaserve/stats answers (from
/metrics) shows the polls arriving; the polls answered during each sample are recorded. Throughput: generated
tokens over the sample's wall time, median of the repeats. The ratio to closed is the median over repeats of
each repeat's ratio (the samples of a repeat run back to back, so the VM's drift between repeats cancels);
the ratio of the medians is recorded too. Writes benchmarks/results/console.json and .png.
"""

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from benchmarks.bench_http import (
    ENGINE,
    MODEL,
    RESULTS,
    SERVED_NAME,
    http_load,
    measured,
    pooled,
    summarize,
    workload,
)
from benchmarks.machine import cpu_name
from benchmarks.ports import free_port

STATES = ("closed", "polled", "browser")
STATS_HANDLER = "/v1/numaserve/stats"
CHROMIUM_FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage")
POLLING_TIMEOUT_S = 60.0


def stats_polls(url: str) -> int:
    """The /v1/numaserve/stats requests the server has answered (its http_requests_total)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{url}/metrics", timeout=30).text
    return int(sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == "http_requests_total" and s.labels.get("handler") == STATS_HANDLER))


# the polled state's client: GET the stats once a second over one connection, as the page does
POLLER = """
import http.client, sys, time
host, port = sys.argv[1], int(sys.argv[2])
connection = http.client.HTTPConnection(host, port)
while True:
    connection.request("GET", "/v1/numaserve/stats")
    connection.getresponse().read()
    time.sleep(1.0)
"""


class Console:
    """A process polling the live view's stats while open: Chromium showing `/#live` (with a fresh profile),
    or the minimal client above."""

    def __init__(self, url: str, state: str):
        self.url, self.state = url, state
        self.proc: subprocess.Popen | None = None
        self.profile: tempfile.TemporaryDirectory | None = None

    def command(self) -> list[str]:
        if self.state == "polled":
            host, port = self.url.removeprefix("http://").split(":")
            return [sys.executable, "-c", POLLER, host, port]
        chromium = shutil.which("chromium")
        if chromium is None:
            raise SystemExit("no Chromium: install Debian's package (apt-get install chromium)")
        self.profile = tempfile.TemporaryDirectory(prefix="bench-console-")
        return [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile.name}", f"{self.url}/#live"]

    def open(self) -> None:
        before = stats_polls(self.url)
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + POLLING_TIMEOUT_S
        while stats_polls(self.url) < before + 2:  # up and polling
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"the {self.state} console did not start polling")
            time.sleep(0.25)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None
        if self.profile is not None:
            self.profile.cleanup()
            self.profile = None


def run(args, model: str, cores: list[int]) -> dict:
    import ray

    import numaserve as ns

    registry = tempfile.TemporaryDirectory(prefix="bench-console-")
    config = ns.ClusterConfig(
        model=model, engine=ENGINE | {"num_threads": len(cores)},
        machines=[{"name": "console", "numa_nodes": [{"id": 0, "cpus": cores}]}],
        stream_interval_ms=0, target_step_ms=1e6, max_queued_per_worker=64,
        adapter_registry=str(Path(registry.name) / "adapters.json"),
        http={"port": free_port(), "served_model_name": SERVED_NAME})
    ray.init(num_cpus=len(cores), resources=config.ray_resources("console"), include_dashboard=False,
             namespace="numaserve", log_to_driver=False)
    client = ns.serve(config, name="bench-console")
    url = client.http_url
    consoles = {state: Console(url, state) for state in STATES[1:]}
    raw = {c: {state: [] for state in STATES} for c in args.concurrency}
    try:
        asyncio.run(http_load(url, workload(2, args.prompt_len, seed=10**6), args.max_tokens, 2))  # warm-up
        for rep in range(args.repeats):
            for c in args.concurrency:
                for state in STATES[rep % 3:] + STATES[:rep % 3]:
                    seed = 10_000 * rep + 10 * c + STATES.index(state)
                    load = http_load(url, workload(max(2 * c, 4), args.prompt_len, seed), args.max_tokens, c)
                    console = consoles.get(state)
                    if console is not None:
                        console.open()
                    try:
                        polls = stats_polls(url)
                        result = measured(lambda load=load: asyncio.run(load))
                        summary = summarize(result) | {"console_polls": stats_polls(url) - polls}
                    finally:
                        if console is not None:
                            console.close()
                    summary["console_polls_per_s"] = summary["console_polls"] / summary["seconds"]
                    raw[c][state].append(summary)
                    print(f"rep {rep} c={c} console {state}: {summary['tokens_per_s']:.1f} tok/s, "
                          f"{summary['console_polls']} polls in {summary['seconds']:.1f} s", flush=True)
    finally:
        for console in consoles.values():
            console.close()
        client.shutdown()
        ray.shutdown()
    return raw


def level_results(raw: dict) -> dict:
    levels = {}
    for c, states in raw.items():
        level = {state: pooled(runs) | {"median_console_polls_per_s": statistics.median(
            r["console_polls_per_s"] for r in runs)} for state, runs in states.items()}
        for state in STATES[1:]:
            pairs = zip(states[state], states["closed"])  # one repeat's samples
            level[f"{state}_over_closed"] = statistics.median(r["tokens_per_s"] / closed["tokens_per_s"]
                                                              for r, closed in pairs)
            level[f"{state}_over_closed_of_medians"] = (level[state]["median_tokens_per_s"]
                                                        / level["closed"]["median_tokens_per_s"])
        level["runs"] = {state: [{k: v for k, v in r.items() if not isinstance(v, list)} for r in runs]
                         for state, runs in states.items()}
        levels[str(c)] = level
    return levels


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = list(results["levels"])
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.27
    labels = {"closed": "no console", "polled": "stats polled once a second (browser elsewhere)",
              "browser": "live view in Chromium on the same cores"}
    for i, (state, color) in enumerate(zip(STATES, ("#777", "#2a9d58", "#2f6fdf"))):
        values = [results["levels"][c][state]["median_tokens_per_s"] for c in levels]
        bars = ax.bar([x + (i - 1) * width for x in range(len(levels))], values, width, color=color,
                      label=labels[state])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(levels)), [
        f"{c} streams\npolled {results['levels'][c]['polled_over_closed']:.3f}, "
        f"browser {results['levels'][c]['browser_over_closed']:.3f}" for c in levels])
    ax.set_ylabel("generated tokens/s (median)")
    ax.legend(fontsize=8)
    ax.set_title(f"HTTP streams while the web console's live view polls, against none\n"
                 f"{results['meta']['model']}, {results['meta']['num_cores']} cores shared by all",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--concurrency", default="1,16", type=lambda s: [int(c) for c in s.split(",")],
                        help="concurrent streams per level, comma-separated")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=12, help="samples of each state at each level")
    parser.add_argument("--out", default=str(RESULTS / "console.json"),
                        help="JSON to write (and the PNG beside it)")
    args = parser.parse_args(argv)
    from benchmarks.checkpoints import with_word_tokenizer

    model = str(with_word_tokenizer(MODEL))
    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    levels = level_results(run(args, model, cores))
    results = {"meta": {"command": "python -m benchmarks.bench_console " + " ".join(
                            sys.argv[1:] if argv is None else argv),
                        "model": f"{MODEL} (random weights, word tokenizer)", "engine": ENGINE,
                        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
                        "num_cores": len(cores), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                        "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "states": {"closed": "no console",
                                   "polled": "a minimal client polling /v1/numaserve/stats once a second",
                                   "browser": "Debian's Chromium, headless, showing /#live, on the same "
                                              "cores as the deployment"}},
               "levels": levels}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    for c, level in levels.items():
        print(f"{c:>2} streams: " + ", ".join(
            f"{state} {level[state]['median_tokens_per_s']:.1f} tok/s "
            f"({level[state]['median_console_polls_per_s']:.2f} polls/s)" for state in STATES)
            + f"; polled / closed {level['polled_over_closed']:.3f}, browser / closed "
              f"{level['browser_over_closed']:.3f}")


if __name__ == "__main__":
    main()
