"""Latency of one all-reduce of the tensor-parallel group's shared segment (memory/shared_group.py) between
processes pinned to cores of their own: 1 / 8 / 32 rows of hidden 2048 / 4096 / 8192 float32, the shapes a
decode or a small prefill step reduces twice a layer.

Each rank is a process of its own, pinned to one core (or to an equal share of the allowed cores), as a
tensor-parallel rank is. The ranks run the same script: per shape, untimed warm-up all-reduces, then --iters
timed ones of each way (MODES) alternating (rank 0 times each, from the write of a fresh input, so nothing
stays in a cache it would not in a forward). The shapes interleave round by round, so a swing in the
VM's speed hits all alike. The median reported is the forward's way (in_slot); copied_median_us the other's.

    python -m benchmarks.bench_all_reduce [--ranks 2] [--iters 2000] [--rounds 5]

Writes benchmarks/results/all_reduce.json and all_reduce.png.
"""

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
ROWS = (1, 8, 32)
HIDDEN = (2048, 4096, 8192)
TARGETS_US = {(1, 4096): 15.0, (32, 4096): 60.0}  # the tensor-parallel issue's bounds on this VM
WARMUP = 200
# in_slot: the partial written into the rank's slot of the segment, then summed into a private array (what a
# forward does: models/tensor_parallel/collectives.py); copied: the partial written into a private array,
# copied into the slot by the all-reduce, and the sum written over it (the embedding's). Both time the
# partial's write (its producer's), so they compare; the median reported is in_slot's
MODES = ("in_slot", "copied")


def core_shares(num_ranks: int) -> list[tuple[int, ...]]:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < num_ranks:
        raise SystemExit(f"{num_ranks} ranks need as many cores; this process may use {len(cores)}")
    per = len(cores) // num_ranks
    return [tuple(cores[r * per:(r + 1) * per]) for r in range(num_ranks)]


def run_rank(layout, rank: int, cores: tuple[int, ...], args, results) -> None:
    from memory.numa import pin_process
    from memory.shared_group import SharedGroup

    pin_process(cores)
    group = SharedGroup.create(layout) if rank == 0 else SharedGroup.attach(layout, rank)
    if rank == 0:
        group.wait_attached()
    rng = np.random.default_rng(rank)
    inputs = {(r, h): rng.standard_normal((2, r, h)).astype(np.float32) for r in ROWS for h in HIDDEN}
    times: dict[str, dict[str, list[float]]] = {mode: {f"{r}x{h}": [] for r in ROWS for h in HIDDEN}
                                                 for mode in MODES}
    for round_ in range(args.rounds + 1):
        for (r, h), src in inputs.items():
            x = np.empty((r, h), np.float32)
            for i in range(WARMUP if round_ == 0 else 2 * args.iters):
                mode = MODES[i % 2]  # alternating: a swing of the VM's speed hits both alike
                if mode == "in_slot":  # the partial written into the slot (timed: its producer's writes)
                    start = time.perf_counter_ns()
                    part = group.next_part(r, h)
                    part[:] = src[i // 2 % 2]
                    group.all_reduce(part, out=x)
                else:
                    start = time.perf_counter_ns()
                    x[:] = src[i // 2 % 2]
                    group.all_reduce(x)
                if round_:
                    times[mode][f"{r}x{h}"].append((time.perf_counter_ns() - start) / 1e3)
    if rank == 0:
        results.put(times)
    group.close()


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for h in HIDDEN:
        ax.plot(ROWS, [results["rows"][f"{r}x{h}"]["median_us"] for r in ROWS], marker="o",
                label=f"hidden {h}")
    for (r, h), bound in TARGETS_US.items():
        ax.plot([r], [bound], marker="_", markersize=20, color="red")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ROWS, [str(r) for r in ROWS])
    ax.set_xlabel("rows (tokens) reduced at once")
    ax.set_ylabel("median latency (us)")
    ax.set_title(f"all-reduce of {results['ranks']} pinned processes, float32, {results['machine']['cpu']}"
                 "\n(red: the issue's bounds at hidden 4096)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=2000, help="timed all-reduces per shape and round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every shape")
    parser.add_argument("--out", type=Path, default=RESULTS / "all_reduce.json")
    args = parser.parse_args()
    from memory.shared_group import GroupLayout

    layout = GroupLayout.new(args.ranks, slot_elems=max(ROWS) * max(HIDDEN))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    shares = core_shares(args.ranks)
    procs = [ctx.Process(target=run_rank, args=(layout, r, shares[r], args, queue))
             for r in range(args.ranks)]
    for p in procs:
        p.start()
    times = queue.get(timeout=3600)
    for p in procs:
        p.join(60)
    rows = {}
    for key, samples in times["in_slot"].items():
        med = statistics.median(samples)
        copied = times["copied"][key]
        rows[key] = {"median_us": med, "p10_us": float(np.percentile(samples, 10)),
                     "p90_us": float(np.percentile(samples, 90)), "samples": len(samples),
                     "copied_median_us": statistics.median(copied),
                     "bytes": 4 * int(np.prod([int(v) for v in key.split("x")]))}
        bound = TARGETS_US.get(tuple(int(v) for v in key.split("x")))
        if bound is not None:
            rows[key]["target_us"] = bound
            rows[key]["met"] = med <= bound
        print(f"{key}: median {med:.1f} us, p90 {rows[key]['p90_us']:.1f} us, copied in "
              f"{rows[key]['copied_median_us']:.1f} us"
              + (f" (target {bound} us: {'met' if med <= bound else 'missed'})" if bound else ""), flush=True)
    results = {"command": "python -m benchmarks.bench_all_reduce " + " ".join(sys.argv[1:]),
               "machine": {"cpu": cpu_name(), "platform": platform.platform()}, "ranks": args.ranks,
               "cores": [list(s) for s in shares], "iters": args.iters, "rounds": args.rounds,
               "date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
