"""Soak: a deployment under Poisson arrivals for a while (mixed prompt and output lengths, some clients
disconnecting after two chunks, some requests with a deadline they cannot meet, some with an adapter), then
drained: every request either completes or ends the expected way, no KV block stays in use, and the workers'
RSS is compared before and after. run_soak() is the driver; tests/cluster/test_soak.py runs it for 60 s.
With --http the same deployment is soaked through its OpenAI API instead (benchmarks/soak_http.py).

    .venv/bin/python -m benchmarks.bench_soak --duration-s 600   # -> benchmarks/results/soak.json + soak.png
    .venv/bin/python -m benchmarks.bench_soak --http             # -> benchmarks/results/soak_http.json + .png
    .venv/bin/python -m benchmarks.bench_soak --http --chaos     # -> results/soak_http_chaos.json + .png

With --chaos an actor of the deployment (a worker, the router, the scheduler, the adapter cache, one of its
two HTTP actors) is killed every 20-60 s while the HTTP soak runs (benchmarks/chaos.py), and every greedy
request that completed is sent again undisturbed afterwards and its answer compared.
"""

import argparse
import json
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

import numaserve as ns

RESULTS = Path(__file__).resolve().parent / "results"
MAX_CONCURRENT = 32
STREAM_BOUND_S = 120.0  # a request still running this long after the arrivals stop counts as hung


@dataclass
class Outcome:
    kind: str  # "plain" | "adapter" | "disconnect" | "deadline"
    arrival_s: float
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # per token after the first
    num_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    done: bool = False


def _one(client, rng_seed: int, kind: str, adapter: str | None, arrival_s: float) -> Outcome:
    rng = np.random.default_rng(rng_seed)
    out = Outcome(kind, arrival_s)
    prompt = rng.integers(3, 384, int(rng.integers(4, 96))).tolist()
    max_tokens = int(rng.choice([4, 16, 32, 64]))
    params = ns.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                               temperature=0 if rng.random() < 0.5 else 0.8, seed=rng_seed)
    if kind == "deadline":  # far more tokens than its deadline allows: the engine aborts it
        params = params.model_copy(update={"max_tokens": 400, "deadline_s": 0.05})
    start = time.monotonic()
    last = start
    try:
        stream = client.stream(prompt, params, adapter=adapter if kind == "adapter" else None)
        for i, chunk in enumerate(stream):
            now = time.monotonic()
            if chunk.token_ids:
                if out.ttft_s is None:
                    out.ttft_s = now - start
                else:  # tokens of one chunk share its gap
                    out.itl_s += [(now - last) / len(chunk.token_ids)] * len(chunk.token_ids)
                last = now
            out.num_tokens += len(chunk.token_ids)
            out.finish_reason = chunk.finish_reason or out.finish_reason
            if kind == "disconnect" and i == 1:
                stream.close()  # the client goes away: the router aborts the request on its worker
                out.finish_reason = "closed"
                break
    except Exception as e:  # noqa: BLE001  (counted and reported: the soak's point)
        out.error = f"{type(e).__name__}: {e}"
    out.done = True
    return out


def _expected(o: Outcome) -> bool:
    """Ended the way its kind should: completed, closed by its client, or aborted at its deadline."""
    if o.error is not None:
        return False
    if o.kind == "disconnect":
        return o.finish_reason in ("closed", "length")
    if o.kind == "deadline":
        return o.finish_reason in ("abort", "length")
    return o.finish_reason == "length"


def worker_figures(client) -> dict:
    """worker id -> (num_blocks, num_free_blocks, num_running + num_waiting, rss_bytes)."""
    return {w: (s["num_blocks"], s["num_free_blocks"], s["num_running"] + s["num_waiting"], s["rss_bytes"])
            for w, s in client.stats()["workers"].items()}


def drained(client, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        figures = worker_figures(client)
        idle = all(busy == 0 and free == total for total, free, busy, _ in figures.values())
        if idle or time.monotonic() > deadline:
            return figures
        time.sleep(0.2)


def warm(client, adapter: str | None) -> None:
    """Concurrent requests of the soak's longest prompt, half on the adapter: the kernels (and the adapter)
    its shapes need are compiled or loaded before RSS is first read. With a bare 3-token warm-up, the 60 s
    test on a cold numba cache saw one worker grow 302 -> 511 MB while it compiled the tiled prefill attention
    (its cache file was written during the soak); the rerun on the warm cache grew under 64 MiB."""
    params = ns.SamplingParams(max_tokens=16, ignore_eos=True)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: client.generate(list(range(3, 98)), params,
                                                adapter=adapter if i % 2 else None), range(8)))


def arrivals(rng, duration_s: float, rate_per_s: float, kinds: list[str], weights, wait_s: float,
             one, more=None) -> tuple[list, list, set]:
    """Poisson arrivals at rate_per_s for duration_s (and while more() says so, up to 4x as long), each
    one(seed, kind, arrival_s) in a thread of its own (at most MAX_CONCURRENT in flight: later arrivals wait,
    the client's own bound), then up to wait_s for them to end -> (futures, outcomes of those done, futures
    still pending: hung, cancelled)."""
    slots = threading.BoundedSemaphore(MAX_CONCURRENT)
    futures, t0 = [], time.monotonic()

    def going(at: float) -> bool:
        return at < t0 + duration_s or (more is not None and more() and at < t0 + 4 * duration_s)

    with ThreadPoolExecutor(MAX_CONCURRENT) as pool:
        next_at = t0
        while going(next_at := next_at + rng.exponential(1 / rate_per_s)):
            time.sleep(max(0.0, next_at - time.monotonic()))
            slots.acquire()
            kind = str(rng.choice(kinds, p=weights))
            fut = pool.submit(one, int(rng.integers(1 << 31)), kind, next_at - t0)
            fut.add_done_callback(lambda _: slots.release())
            futures.append(fut)
        _, pending = wait(futures, timeout=wait_s)
        outcomes = [f.result() for f in futures if f.done()]
        for f in pending:
            f.cancel()
    return futures, outcomes, pending


def run_soak(client, duration_s: float, rate_per_s: float, adapter: str | None, seed: int = 0,
             start: threading.Barrier | None = None) -> dict:
    """Poisson arrivals at rate_per_s for duration_s (at most MAX_CONCURRENT in flight), then a drain (of
    the whole deployment). start: a barrier the arrivals wait at, after the warm-up and the first RSS reading
    (drivers soaking one deployment side by side)."""
    rng = np.random.default_rng(seed)
    kinds = ["plain", "adapter", "disconnect", "deadline"]
    weights = [0.6, 0.2 if adapter else 0.0, 0.1, 0.1]
    weights = np.array(weights) / sum(weights)
    warm(client, adapter)
    rss_before = {w: f[3] for w, f in drained(client, 30).items()}
    if start is not None:
        start.wait()
    t0 = time.monotonic()
    futures, outcomes, pending = arrivals(rng, duration_s, rate_per_s, kinds, weights, STREAM_BOUND_S,
                                          lambda seed, kind, at_s: _one(client, seed, kind, adapter, at_s))
    num_hung = len(pending)
    elapsed = time.monotonic() - t0
    after = drained(client, 60)
    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [x for o in outcomes for x in o.itl_s]
    unexpected = [o for o in outcomes if not _expected(o)]
    pct = (lambda xs, q: float(np.percentile(xs, q)) if xs else None)
    return {
        "duration_s": duration_s, "elapsed_s": round(elapsed, 1), "rate_per_s": rate_per_s,
        "num_requests": len(futures), "num_hung": num_hung,
        "num_completed": sum(o.finish_reason == "length" and o.error is None for o in outcomes),
        "by_kind": {k: sum(o.kind == k for o in outcomes) for k in kinds},
        "num_deadline_aborted": sum(o.kind == "deadline" and o.finish_reason == "abort" for o in outcomes),
        "num_disconnected": sum(o.finish_reason == "closed" for o in outcomes),
        "num_errors": len(unexpected), "errors": sorted({o.error or f"{o.kind}: {o.finish_reason}"
                                                         for o in unexpected})[:10],
        "num_tokens": sum(o.num_tokens for o in outcomes),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99),
        "num_blocks_leaked": sum(total - free for total, free, _, _ in after.values()),
        "num_requests_left": sum(busy for _, _, busy, _ in after.values()),
        "rss_before_bytes": rss_before, "rss_after_bytes": {w: f[3] for w, f in after.items()},
        "outcomes": [asdict(o) | {"itl_s": None} for o in outcomes],
    }


def _plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # the first text: a stream's first chunk, a whole answer otherwise (HTTP)
    done = [(o["arrival_s"], o["ttft_s"] or o.get("latency_s"), o["kind"]) for o in result["outcomes"]
            if (o["ttft_s"] or o.get("latency_s")) is not None]
    fig, ax = plt.subplots(figsize=(8, 4))
    for kind in result["by_kind"]:
        ax.scatter([a for a, _, k in done if k == kind], [1000 * t for _, t, k in done if k == kind], s=4,
                   label=kind)
    ax.set(xlabel="arrival (s)", ylabel="first text (ms)", yscale="log",
           title=f"{path.stem} {result['duration_s']:.0f} s: {result['num_completed']} completed, "
                 f"{result['num_errors']} errors, {result['num_hung']} hung, "
                 f"{result['num_blocks_leaked']} blocks leaked")
    ax.legend(markerscale=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--http", action="store_true",
                        help="through the OpenAI API with the openai client (benchmarks/soak_http.py)")
    parser.add_argument("--chaos", action="store_true", help="with --http: kill an actor every 20-60 s")
    parser.add_argument("--chaos-seed", type=int, default=0)
    parser.add_argument("--chaos-interval", type=float, nargs=2, default=(20.0, 60.0),
                        metavar=("MIN_S", "MAX_S"), help="seconds from one kill to the next")
    parser.add_argument("--out", type=Path, default=None,
                        help="default: results/soak.json, soak_http.json or soak_http_chaos.json")
    args = parser.parse_args()
    if args.chaos and not args.http:
        parser.error("--chaos soaks the HTTP API: add --http")
    out = args.out or RESULTS / ("soak_http_chaos.json" if args.chaos else
                                 "soak_http.json" if args.http else "soak.json")
    from benchmarks.chaos import Chaos
    from benchmarks.ports import free_port
    from benchmarks.soak_http import run_http_soak
    from tests.cluster.conftest import sim_config
    from tests.models.test_lora import make_adapter
    from tests.support.model_factory import build_model

    root = Path(tempfile.mkdtemp(prefix="soak-"))
    build_model(root / "llama", "llama")
    make_adapter(root / "llama", root / "adapter", seed=1)
    # under chaos two HTTP actors share the port: one killed, the other serves while it restarts
    http = {"port": free_port()} | ({"replicas": 2} if args.chaos else {})
    config = sim_config("two_numa_sim", engine={"max_num_seqs": 16}, max_queued_per_worker=16,
                        adapter_registry=str(root / "adapters.json"), http=http if args.http else None)
    client = ns.serve(config, model=root / "llama", name="soak")
    try:
        client.register_adapter("a", root / "adapter")
        if args.http:
            chaos = Chaos(client, "a", args.chaos_seed, tuple(args.chaos_interval)) if args.chaos else None
            result = run_http_soak(client, args.duration_s, args.rate, "a", chaos=chaos)
        else:
            result = run_soak(client, args.duration_s, args.rate, "a")
    finally:
        client.shutdown()
    chaos_flags = (f" --chaos --chaos-seed {args.chaos_seed} --chaos-interval "
                   f"{args.chaos_interval[0]:g} {args.chaos_interval[1]:g}") if args.chaos else ""
    result["command"] = (f"python -m benchmarks.bench_soak{' --http' if args.http else ''}{chaos_flags} "
                         f"--duration-s {args.duration_s:g} --rate {args.rate:g}")
    from benchmarks.bench_revisions import revision
    from benchmarks.machine import cpu_name
    result |= {"revision": revision(RESULTS.parents[1]), "date": time.strftime("%Y-%m-%d %H:%M"),
               "cpu": cpu_name()}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    _plot(result, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "outcomes"}, indent=1))


if __name__ == "__main__":
    main()
