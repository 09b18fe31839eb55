"""Load through the OpenAI-compatible HTTP API against the same load through the in-process engine.

    python -m benchmarks.bench_http [--concurrency 1,4,16,64] [--prompt-len 8] [--max-tokens 32] [--repeats 2]
                                    [--stream-interval-ms 0]

The TinyLlama-1.1B-shaped random checkpoint (benchmarks/checkpoints.py, with a word tokenizer so every token
streams text) with q8_0 weights. Closed loop at each concurrency c: c streams in flight, each request
(prompt-len random token ids, max-tokens greedy tokens, ignore_eos) followed by the next until max(c, 4) are
done.
- HTTP: a deployment of one worker on every core (two threads on this 2-core machine), its router and HTTP
  server on the same cores, driven over loopback by asyncio `openai` clients in this process; streamed
  with stream_interval_ms 0 by default (a chunk per engine step, so chunk gaps are inter-token latencies) and
  include_usage (token counts from usage).
- in-process: numaserve.LLM in its own process (benchmarks/llm_load_worker.py) with the same EngineConfig
  and threads; a token's time is when the engine step that made it returns.
Both paths batch the same way: target_step_ms is set out of reach so the deployment's policy keeps the
full token budget, as the in-process engine does. The paths alternate level by level, the order flipping
every repeat; throughput is generated tokens over the wall time from the first request to the last token
(median of the repeats), TTFT and ITL percentiles pool every request of the repeats. CPU seconds per token
are the whole machine's busy time (every process: client, Ray, the engine) over the run.
Writes benchmarks/results/http.json and http.png.
"""

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import psutil

from benchmarks.machine import cpu_name
from benchmarks.ports import free_port

RESULTS = Path(__file__).parent / "results"
MODEL = "tinyllama-1.1b"
SERVED_NAME = "tinyllama-q8_0"
ENGINE = {"weight_dtype": "q8_0", "max_num_seqs": 64, "max_num_batched_tokens": 512,
          "kv_cache_bytes": 256 << 20}
MIN_REQUESTS = 4
PATHS = ("http", "in-process")


def workload(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 32000, prompt_len).tolist() for _ in range(num_requests)]


async def http_load(url: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> dict:
    """The in-process runner's result shape: {"seconds", "requests": [{"start", "times", "num_tokens"}]}."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    pending, done = list(prompts), []

    async def one(prompt: list[int]) -> dict:
        record = {"start": time.perf_counter(), "times": [], "num_tokens": 0, "num_chunks": 0}
        stream = await client.completions.create(model=SERVED_NAME, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                record["times"].append(now)
            if chunk.usage is not None:
                record["num_tokens"] = chunk.usage.completion_tokens
        return record

    async def lane() -> None:
        while pending:
            done.append(await one(pending.pop(0)))

    start = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(concurrency)))
    seconds = time.perf_counter() - start
    await client.close()
    return {"seconds": seconds, "requests": done}


def measured(run) -> dict:
    """run() with the machine's busy CPU seconds over it."""
    before = psutil.cpu_times()
    result = run()
    after = psutil.cpu_times()
    busy = sum(after) - after.idle - after.iowait - (sum(before) - before.idle - before.iowait)
    return result | {"cpu_seconds": busy}


def summarize(run: dict) -> dict:
    requests = run["requests"]
    num_tokens = sum(r["num_tokens"] for r in requests)
    return {"tokens_per_s": num_tokens / run["seconds"], "seconds": run["seconds"], "num_tokens": num_tokens,
            "num_requests": len(requests), "cpu_ms_per_token": 1000 * run["cpu_seconds"] / num_tokens,
            "tokens_per_chunk": num_tokens / sum(len(r["times"]) for r in requests),
            "ttft_s": [r["times"][0] - r["start"] for r in requests],
            # time per output token after the first (vLLM's TPOT): the same on both paths however tokens are
            # chunked, where the gaps between chunks (itl_s) are per token only at a chunk per step
            "tpot_s": [(r["times"][-1] - r["times"][0]) / (r["num_tokens"] - 1) for r in requests
                       if r["num_tokens"] > 1],
            "itl_s": [b - a for r in requests for a, b in zip(r["times"], r["times"][1:])]}


def pooled(runs: list[dict]) -> dict:
    ttft = [x for r in runs for x in r["ttft_s"]]
    itl = [x for r in runs for x in r["itl_s"]]
    tpot = [x for r in runs for x in r["tpot_s"]]
    pct = {f"{name}_p{q}_ms": 1000 * float(np.percentile(xs, q))
           for name, xs in (("ttft", ttft), ("itl", itl), ("tpot", tpot))
           for q in (50, 99)}
    return {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
            "median_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in runs),
            "tokens_per_chunk": statistics.median(r["tokens_per_chunk"] for r in runs),
            "num_ttft_samples": len(ttft), "num_itl_samples": len(itl)} | pct


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = [int(c) for c in results["levels"]]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    styles = {"http": ("#3a7", "HTTP (openai client, loopback)"),
              "in-process": ("#777", "in-process numaserve.LLM")}
    for name, (color, label) in styles.items():
        rows = [results["levels"][str(c)][name] for c in levels]
        axes[0].plot(levels, [r["median_tokens_per_s"] for r in rows], "o-", color=color, label=label)
        for ax, metric in ((axes[1], "ttft"), (axes[2], "itl")):
            ax.plot(levels, [r[f"{metric}_p50_ms"] for r in rows], "o-", color=color, label=f"{label} p50")
            ax.plot(levels, [r[f"{metric}_p99_ms"] for r in rows], "s--", color=color, label=f"{label} p99")
    for ax, title, unit in ((axes[0], "output throughput", "tokens/s"),
                            (axes[1], "time to first token", "ms"),
                            (axes[2], "inter-token latency", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(unit)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    ratios = ", ".join(f"{c}: {results['levels'][str(c)]['http_over_in_process']:.3f}" for c in levels)
    dedicated = "; worker on a core of its own: " + ", ".join(
        f"{c}: {level['http_over_in_process']:.3f}" for c, level in results["dedicated"].items()) \
        if results["dedicated"] else ""
    fig.suptitle(f"TinyLlama-1.1B-shaped q8_0, {results['meta']['num_cores']} cores shared by worker and "
                 f"the rest: HTTP / in-process throughput by streams {ratios}{dedicated} "
                 "(goal >= 0.95 at 16)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def pin(pid: int, cpu_ids: list[int]) -> None:
    """Pin every thread of a process."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpu_ids)
        except (ProcessLookupError, PermissionError):
            pass


def run_layout(layout: str, args, model: str, cores: list[int], levels: list[int]) -> dict:
    """{concurrency: {path: [summary per repeat]}} for one layout: "shared" (the worker, or the in-process
    engine, on every core, sharing them with client, router, HTTP server and Ray) or "dedicated" (the worker,
    or the engine, on the last core with one thread; everything else on the other cores)."""
    import ray

    import numaserve as ns
    from benchmarks.engine_process import EngineProcess

    engine_cores = cores if layout == "shared" else cores[-1:]
    other_cores = cores if layout == "shared" else cores[:-1]
    engine = ns.EngineConfig(**ENGINE, num_threads=len(engine_cores))
    threads_env = {"NUMBA_NUM_THREADS": str(len(engine_cores)), "OMP_NUM_THREADS": str(len(engine_cores))}
    in_process = EngineProcess(f"in-process ({layout})", "benchmarks.llm_load_worker",
                               [model, engine.model_dump_json(), ",".join(map(str, engine_cores))],
                               os.environ | threads_env)  # the worker's environment, as deploy sets it
    registry = tempfile.TemporaryDirectory(prefix="bench-http-")
    config = ns.ClusterConfig(
        model=model, engine=ENGINE,
        machines=[{"name": layout, "numa_nodes": [{"id": 0, "cpus": engine_cores}]}],
        stream_interval_ms=args.stream_interval_ms, target_step_ms=1e6, max_queued_per_worker=64,
        adapter_registry=str(Path(registry.name) / "adapters.json"),
        http={"port": free_port(), "served_model_name": SERVED_NAME})
    ray.init(num_cpus=len(cores), resources=config.ray_resources(layout), include_dashboard=False,
             namespace="numaserve", log_to_driver=False)
    client = ns.serve(config, name=f"bench-http-{layout}")
    raw = {c: {path: [] for path in PATHS} for c in levels}
    try:
        [worker] = client.stats()["workers"].values()
        # every process but the worker (and the stopped in-process engine) off its core
        if layout == "dedicated":
            for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:  # this process and Ray's
                if p.pid not in (worker["info"]["pid"], in_process.proc.pid):
                    pin(p.pid, other_cores)
        url = client.http_url

        def run(path: str, prompts: list, concurrency: int) -> dict:
            if path == "http":
                return measured(lambda: asyncio.run(http_load(url, prompts, args.max_tokens, concurrency)))
            return measured(lambda: in_process.call("run", prompts=prompts, max_tokens=args.max_tokens,
                                                    concurrency=concurrency))

        warm = workload(2, args.prompt_len, seed=10**6)
        for path in PATHS:
            run(path, warm, 2)
        for rep in range(args.repeats):
            order = PATHS if rep % 2 == 0 else PATHS[::-1]
            for c in levels:
                prompts = workload(max(c, MIN_REQUESTS), args.prompt_len, seed=1000 * rep + c)
                for path in order:
                    summary = summarize(run(path, prompts, c))
                    raw[c][path].append(summary)
                    print(f"{layout} rep {rep} c={c} {path}: " + json.dumps(
                        {k: round(v, 3) for k, v in summary.items() if not isinstance(v, list)}), flush=True)
    finally:
        client.shutdown()
        in_process.close()
        ray.shutdown()
    return raw


def level_results(raw: dict) -> dict:
    levels = {}
    for c, paths in raw.items():
        level = {path: pooled(runs) for path, runs in paths.items()}
        level["http_over_in_process"] = level["http"]["median_tokens_per_s"] / \
            level["in-process"]["median_tokens_per_s"]
        level["runs"] = {path: [{k: v for k, v in r.items() if not isinstance(v, list)} for r in runs]
                         for path, runs in paths.items()}
        levels[str(c)] = level
    return levels


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16,64", type=lambda s: [int(c) for c in s.split(",")],
                        help="concurrent streams per level with the worker on every core, comma-separated")
    parser.add_argument("--dedicated-concurrency", default="16",
                        type=lambda s: [int(c) for c in s.split(",") if c],
                        help="levels also run with the worker on a core of its own (empty: none)")
    parser.add_argument("--prompt-len", type=int, default=8, help="prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path at each level")
    parser.add_argument("--stream-interval-ms", type=float, default=0,
                        help="the deployment's stream_interval_ms (0: a chunk per engine step, so the gaps "
                             "between chunks are inter-token times; the deployment's default is 100)")
    parser.add_argument("--out", default=str(RESULTS / "http.json"),
                        help="JSON to write (and the PNG beside it)")
    args = parser.parse_args(argv)
    from benchmarks.checkpoints import with_word_tokenizer

    model = str(with_word_tokenizer(MODEL))
    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()
    layouts = {"shared": level_results(run_layout("shared", args, model, cores, args.concurrency))}
    if args.dedicated_concurrency and len(cores) > 1:
        layouts["dedicated"] = level_results(run_layout("dedicated", args, model, cores,
                                                        args.dedicated_concurrency))
    results = {"meta": {"command": "python -m benchmarks.bench_http " + " ".join(
                            sys.argv[1:] if argv is None else argv),
                        "model": f"{MODEL} (random weights, word tokenizer)", "engine": ENGINE,
                        "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "repeats": args.repeats,
                        "min_requests": MIN_REQUESTS, "stream_interval_ms": args.stream_interval_ms,
                        "target_step_ms": 1e6,
                        "num_cores": len(cores), "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                        "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "layouts": {"shared": "worker (or in-process engine) on every core with one thread "
                                              "each, sharing them with client, router, HTTP server and Ray",
                                    "dedicated": "worker (or in-process engine) on the last core, "
                                                 "one thread; "
                                                 "client, router, HTTP server and Ray on the others"}},
               "levels": layouts["shared"], "dedicated": layouts.get("dedicated", {})}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    plot(results, out.with_suffix(".png"))
    for layout, levels in layouts.items():
        for c, level in levels.items():
            h, p = level["http"], level["in-process"]
            print(f"{layout}, {c:>2} streams: HTTP {h['median_tokens_per_s']:.1f} tok/s vs in-process "
                  f"{p['median_tokens_per_s']:.1f} ({level['http_over_in_process']:.3f}); TTFT p50 "
                  f"{h['ttft_p50_ms']:.0f} / {p['ttft_p50_ms']:.0f} ms, ITL p50 {h['itl_p50_ms']:.0f} / "
                  f"{p['itl_p50_ms']:.0f} ms, p99 {h['itl_p99_ms']:.0f} / {p['itl_p99_ms']:.0f} ms, TPOT p50 "
                  f"{h['tpot_p50_ms']:.1f} / {p['tpot_p50_ms']:.1f} ms")


if __name__ == "__main__":
    main()
