"""What the Ray layer costs, and what NUMA-pinned workers buy.

    python -m benchmarks.bench_serving [--model llama-56m] [--weight-dtype auto] [--activation-dtype auto]
                                       [--prompt-len 64] [--max-tokens 64] [--repeats 5]
                                       [--parts overhead,scaling] [--intervals-ms 0,100,200]
                                       [--kv-cache-mb 64] [--out benchmarks/results/serving.json]

1. overhead: 16 concurrent greedy requests streamed through a Client vs the same requests in an in-process
   engine with the same EngineConfig, cores and threads; tokens/s from the first submit to the last token.
   - dedicated core: the worker (or the in-process engine) has the last core to itself with one thread;
     the client and router run on the other cores, as a serving deployment would place them. Served at
     stream_interval_ms 0 (a chunk per step), 50 (the default) and 200: chunking sets the per-token
     cost of the Ray hops.
   - shared cores: one worker (or the engine) on every core, sharing them with client and router.
2. scaling: the same 32 requests through 2 workers pinned to one core each (two simulated NUMA nodes) vs
   1 worker pinned to one core.

Runs alternate between the compared setups (A B C A B C ...) and medians are reported, because a shared
machine's load drifts; CPU seconds per token of every process involved (driver, router, workers) are
reported beside. Writes benchmarks/results/serving.json and serving.png.
"""

import argparse
import functools
import json
import multiprocessing
import os
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil
import ray

import numaserve as ns
from benchmarks.checkpoints import random_checkpoint

RESULTS = Path(__file__).parent / "results"
INTERVALS_MS = (0, 100, 200)  # stream_interval_ms: a chunk per step, the default, coarser
ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "kv_cache_bytes": 64 << 20}


def cluster_config(machine: str, nodes: list[list[int]], stream_interval_ms: float,
                   engine: dict = ENGINE) -> ns.ClusterConfig:
    return ns.ClusterConfig(engine=engine, max_queued_per_worker=64, stream_interval_ms=stream_interval_ms,
                            machines=[{"name": machine,
                                       "numa_nodes": [{"id": i, "cpus": c} for i, c in enumerate(nodes)]}])


def pin(pid: int, cpu_ids: list[int]) -> None:
    """Pin every thread of a process (numa.pin_process does this for the calling process)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpu_ids)
        except ProcessLookupError:
            pass


def workload(num_requests: int, prompt_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 32000, prompt_len).tolist() for _ in range(num_requests)]


def deployment_processes(client) -> list[psutil.Process]:
    stats = client.stats()
    return ([psutil.Process(stats["router_pid"])]
            + [psutil.Process(w["info"]["pid"]) for w in stats["workers"].values()])


def measure(run, processes: list[psutil.Process]) -> dict:
    """Run once: tokens/s, and CPU seconds per token of this process and the given ones."""
    processes = [psutil.Process()] + processes
    cpu_before = [sum(p.cpu_times()[:2]) for p in processes]
    start = time.perf_counter()
    num_tokens, num_chunks = run()
    seconds = time.perf_counter() - start
    cpu = sum(sum(p.cpu_times()[:2]) - c for p, c in zip(processes, cpu_before))
    return {"tokens_per_s": num_tokens / seconds, "seconds": seconds,
            "cpu_ms_per_token": 1000 * cpu / num_tokens, "tokens_per_chunk": num_tokens / num_chunks}


def engine_process(conn, model: str, engine: dict, cpu_ids: list[int]) -> None:
    """A plain Python process (no Ray in it) running the in-process engine: the baseline as users run it,
    with the thread pool a worker on cpu_ids gets."""
    pin(os.getpid(), cpu_ids)
    llm = ns.LLM(model, **engine, num_threads=len(cpu_ids))
    while (job := conn.recv()) is not None:
        conn.send(measure(functools.partial(generate, llm, *job), []))


def generate(llm: ns.LLM, prompts: list, params: ns.SamplingParams) -> tuple[int, int]:
    return sum(len(o.token_ids) for o in llm.generate(prompts, params)), len(prompts)


class InProcessEngine:
    def __init__(self, model: str, engine: dict, cpu_ids: list[int]):
        spawn = multiprocessing.get_context("spawn")
        self.conn, child = spawn.Pipe()
        env = {"NUMBA_NUM_THREADS": str(len(cpu_ids)), "OMP_NUM_THREADS": str(len(cpu_ids))}  # as deploy sets
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # numba reads them when it loads, in the child
        self.process = spawn.Process(target=engine_process, args=(child, model, engine, cpu_ids))
        self.process.start()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v

    def run(self, prompts: list, params: ns.SamplingParams):
        def run_once():
            self.conn.send((prompts, params))
            return self.conn.recv()
        return run_once

    def close(self) -> None:
        self.conn.send(None)
        self.process.join()


def served(client, prompts: list, params: ns.SamplingParams, client_cpu_ids: list[int]):
    """The client (this process) and the router run on client_cpu_ids."""
    def one(prompt):
        chunks = list(client.stream(prompt, params))
        return sum(len(c.token_ids) for c in chunks), len(chunks)

    def run():
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(one, prompts))
        return sum(n for n, _ in results), sum(c for _, c in results)

    processes = deployment_processes(client)

    def pinned_run():
        pin(os.getpid(), client_cpu_ids)
        pin(processes[0].pid, client_cpu_ids)
        return measure(run, processes)
    return pinned_run


def alternate(runs: dict, repeats: int) -> dict:
    """{name: run} -> {name: medians and every run}, the runs interleaved."""
    raw = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            raw[name].append(run())
            print(f"{name}: " + json.dumps({k: round(v, 3) for k, v in raw[name][-1].items()}), flush=True)
    return {name: {"median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in rs),
                   "median_cpu_ms_per_token": statistics.median(r["cpu_ms_per_token"] for r in rs),
                   "tokens_per_chunk": statistics.median(r["tokens_per_chunk"] for r in rs), "runs": rs}
            for name, rs in raw.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = [(title, results[key]["runs"]) for key, title in
             (("overhead", "16 requests: client vs in-process engine"),
              ("scaling", "32 requests: pinned workers"))
             if key in results]
    fig, axes = plt.subplots(1, len(parts), figsize=(7.5 * len(parts), 4.6), squeeze=False)
    for ax, (title, part) in zip(axes[0], parts):
        names = list(part)
        values = [part[n]["median_tokens_per_s"] for n in names]
        colors = ["#777" if n.startswith(("in-process", "1 worker")) else "#3a7" for n in names]
        ax.bar([n.replace(", ", ",\n") for n in names], values, color=colors)
        for i, v in enumerate(values):
            ax.text(i, v, f"{v:.0f}", ha="center", va="bottom", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("aggregate tokens/s (median)")
        ax.tick_params(axis="x", labelsize=7)
    meta = results["meta"]
    title = f"{meta['model']} ({meta['engine']['weight_dtype']} weights): "
    fig.suptitle(title + "; ".join(summary(results)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def summary(results: dict) -> list[str]:
    """One line per part and stream interval, with its target."""
    lines = []
    for part, name in (("dedicated_core", "dedicated core"), ("shared_cores", "shared cores")):
        if "overhead" in results:
            lines.append(f"client overhead, {name} (target <= 5%): " + ", ".join(
                f"{v:.1%} at {ms} ms" for ms, v in results["overhead"][part].items()))
    if "scaling" in results:
        lines.append("2 pinned workers vs one (target >= 1.8x): " + ", ".join(
            f"{v:.2f}x at {ms} ms" for ms, v in results["scaling"]["speedup"].items()))
    return lines


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--weight-dtype", default="auto", help="as EngineConfig.weight_dtype, e.g. q8_0")
    parser.add_argument("--activation-dtype", default="auto",
                        help="as EngineConfig.activation_dtype, e.g. int8")
    parser.add_argument("--kv-cache-mb", type=int, default=ENGINE["kv_cache_bytes"] >> 20,
                        help="each engine's KV cache (TinyLlama's bf16 KV takes 22 KB a token)")
    parser.add_argument("--parts", default="overhead,scaling", help="which parts to run, comma-separated")
    parser.add_argument("--intervals-ms", default=",".join(map(str, INTERVALS_MS)),
                        help="stream_interval_ms values, comma-separated")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.json",
                        help="JSON (and the PNG beside it)")
    args = parser.parse_args()
    model = str(random_checkpoint(args.model))
    engine = ENGINE | {"weight_dtype": args.weight_dtype, "activation_dtype": args.activation_dtype,
                       "kv_cache_bytes": args.kv_cache_mb << 20}
    intervals = tuple(float(ms) if "." in ms else int(ms) for ms in args.intervals_ms.split(","))
    parts = set(args.parts.split(","))
    params = ns.SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    cores = sorted(os.sched_getaffinity(0))
    worker_core, control_cores = cores[-1:], cores[:-1]
    layouts = {"dedicated": [worker_core], "shared": [cores], "single": [cores[:1]],
               "pair": [[c] for c in cores[:2]]}
    configs = {f"{name}{ms}": cluster_config(f"{name}{ms}", nodes, ms, engine)  # one machine name each
               for name, nodes in layouts.items() for ms in intervals}
    resources = {}
    for name, config in configs.items():
        resources |= config.ray_resources(name)
    load_before = os.getloadavg()
    ray.init(num_cpus=len(cores), resources=resources)
    warm, prompts16, prompts32 = (workload(n, length, seed) for n, length, seed in
                                  ((4, 16, 0), (16, args.prompt_len, 1), (32, args.prompt_len, 2)))

    def deploy(layouts_used: tuple[str, ...]) -> dict:
        clients = {f"{n}{ms}": ns.serve(configs[f"{n}{ms}"], model=model, name=f"bench-{n}{ms}")
                   for n in layouts_used for ms in intervals}
        for c in clients.values():
            served(c, warm, params, cores)()
        return clients

    def in_process_engine(cpu_ids: list[int]) -> InProcessEngine:
        in_process = InProcessEngine(model, engine, cpu_ids)
        in_process.run(warm, params)()
        return in_process

    overhead, scaling = {}, {}
    for layout, cpu_ids, client_cpu_ids, label in (("dedicated", worker_core, control_cores, "1 core"),
                                                    ("shared", cores, cores, "all cores")):
        if "overhead" not in parts:
            break
        clients, baseline = deploy((layout,)), in_process_engine(cpu_ids)
        runs = {f"in-process, {label}": baseline.run(prompts16, params)}
        runs |= {f"client, {label}, {ms} ms": served(clients[f"{layout}{ms}"], prompts16, params,
                                                     client_cpu_ids)
                 for ms in intervals}
        overhead |= alternate(runs, args.repeats)
        baseline.close()
        for c in clients.values():
            c.shutdown()
    if "scaling" in parts:
        clients = deploy(("single", "pair"))
        scaling = alternate({f"{label}, {ms} ms": served(clients[f"{name}{ms}"], prompts32, params, cores)
                             for ms in intervals
                             for name, label in (("single", "1 worker, 1 core"),
                                                 ("pair", "2 workers, 1 core each"))},
                            args.repeats)
        for c in clients.values():
            c.shutdown()

    def ratio(name: str, baseline: str, part: dict) -> float:
        return part[name]["median_tokens_per_s"] / part[baseline]["median_tokens_per_s"]

    results = {"meta": {"model": args.model, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                        "repeats": args.repeats, "engine": engine, "cores": cores,
                        "cpu": platform.processor() or platform.machine(),
                        "load_average_before": load_before, "load_average_after": os.getloadavg(),
                        "date": time.strftime("%Y-%m-%d %H:%M")}}
    if overhead:
        results["overhead"] = {
            "dedicated_core": {ms: 1 - ratio(f"client, 1 core, {ms} ms", "in-process, 1 core", overhead)
                               for ms in intervals},
            "shared_cores": {ms: 1 - ratio(f"client, all cores, {ms} ms", "in-process, all cores", overhead)
                             for ms in intervals},
            "runs": overhead}
    if scaling:
        speedup = {ms: ratio(f"2 workers, 1 core each, {ms} ms", f"1 worker, 1 core, {ms} ms", scaling)
                   for ms in intervals}
        results["scaling"] = {"speedup": speedup, "runs": scaling}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    plot(results, args.out.with_suffix(".png"))
    print("\n".join(summary(results)))


if __name__ == "__main__":
    main()
