"""One model on two ranks against one process on the same cores: decode at batch 1 and 8 and a prefill,
numaserve with tensor_parallel_size 2 (two ranks of one thread, each on a core of its own) against
tensor_parallel_size 1 (one process of two threads), the same weights (TinyLlama's shape, q8_0, int8
activations).

On one socket the two ranks share what one process had (the same cores and memory channels), so the bound is
the cost of tensor parallelism itself: the all-reduces, the step plan sent to the follower, and the ranks
waiting for each other. Each TP=2 sample also records the share of its seconds rank 0 spent in the
all-reduces and the logits' gather (stats()["tensor_parallel"]["collective_seconds"], waiting for the other
rank included), and of that the share it waited for the other rank to reach the collective
("collective_wait_seconds": the ranks' imbalance, not the moving and summing). What a second socket would
add (its own memory bandwidth) is the simulator's to project (benchmarks/project_tensor_parallel.py).

Each engine runs in its own process (benchmarks/numaserve_worker.py), loaded once; the engines alternate
sample by sample with the order flipping, unique prompts every sample, medians and ratios from one run.

    python -m benchmarks.bench_tensor_parallel [--samples 5] [--steps 32]

Writes benchmarks/results/tensor_parallel.json and tensor_parallel.png.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import random_checkpoint
from benchmarks.engine_process import EngineProcess
from benchmarks.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
ROWS = ("1", "8", "prefill512")
PROMPT_LEN = 16


def start(label: str, model: Path, size: int, args) -> EngineProcess:
    threads = len(os.sched_getaffinity(0)) // size
    argv = [str(model), "--weight-dtype", args.weight_dtype, "--activation-dtype", args.activation_dtype,
            "--threads", str(threads), "--tensor-parallel-size", str(size)]
    return EngineProcess(label, "benchmarks.numaserve_worker", argv, dict(os.environ))


def sample(engine: EngineProcess, row: str, rng: np.random.Generator,
           steps: int) -> tuple[float, float, float]:
    """(tokens a second, the share of its seconds rank 0 spent in the all-reduces and the logits' gather, and
    of those waiting for the other rank) of one sample of a row (prompts unique to this sample and engine)."""
    before = engine.call("tensor_parallel")
    if row.startswith("prefill"):
        n = int(row.removeprefix("prefill"))
        tokens, seconds = n, engine.call("prefill", prompt=rng.integers(3, 30000, n).tolist())
    else:
        batch = int(row)
        prompts = rng.integers(3, 30000, (batch, PROMPT_LEN)).tolist()
        tokens, seconds = batch * steps, engine.call("decode", prompts=prompts, num_steps=steps)
    after = engine.call("tensor_parallel")
    collectives = after["collective_seconds"] - before["collective_seconds"]
    waits = after["collective_wait_seconds"] - before["collective_wait_seconds"]
    return tokens / seconds, collectives / seconds, waits / seconds


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, label in ((-0.2, "tp1"), (0.2, "tp2")):
        ax.bar(x + offset, [r["median_tokens_per_s"][label] for r in rows], 0.4,
               label=results["engines"][label])
    for i, r in enumerate(rows):
        ax.annotate(f"{r['tp2_over_tp1']:.2f}x", (i, max(r["median_tokens_per_s"].values())), ha="center",
                    va="bottom")
    ax.set_xticks(x, [f"decode batch {r['row']}" if r["row"].isdigit() else r["row"] for r in rows])
    ax.set_ylabel("tokens/s (median)")
    ax.set_title(f"tensor_parallel_size 2 against 1, {results['model']} {results['weight_dtype']}, "
                 f"{results['machine']['cpu']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinyllama-1.1b", help="random checkpoint shape")
    parser.add_argument("--weight-dtype", default="q8_0")
    parser.add_argument("--activation-dtype", default="int8")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32, help="decode steps a sample")
    parser.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel.json")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    if cores < 2 or cores % 2:
        raise SystemExit(f"two ranks need an even number of cores; this process may use {cores}")
    model = random_checkpoint(args.model)
    engines = {"tp1": start("tensor_parallel_size 1", model, 1, args),
               "tp2": start("tensor_parallel_size 2", model, 2, args)}
    rng = np.random.default_rng(0)
    rows = []
    try:
        for row in ROWS:
            for engine in engines.values():  # untimed: compiles what had not been, touches the KV pages
                sample(engine, row, rng, args.steps)
            speeds: dict[str, list[float]] = {label: [] for label in engines}
            shares: list[float] = []  # tp2's: the collectives' share of each sample's seconds
            waits: list[float] = []  # of which waiting for the other rank
            for i in range(args.samples):
                for label in (list(engines) if i % 2 == 0 else list(engines)[::-1]):
                    speed, share, wait = sample(engines[label], row, rng, args.steps)
                    speeds[label].append(speed)
                    if label == "tp2":
                        shares.append(share)
                        waits.append(wait)
            medians = {label: statistics.median(v) for label, v in speeds.items()}
            rows.append({"row": row, "tokens_per_s": speeds, "median_tokens_per_s": medians,
                         "tp2_over_tp1": medians["tp2"] / medians["tp1"], "tp2_collective_shares": shares,
                         "tp2_median_collective_share": statistics.median(shares),
                         "tp2_collective_wait_shares": waits,
                         "tp2_median_collective_wait_share": statistics.median(waits)})
            print(f"{row}: tp1 {medians['tp1']:.1f}, tp2 {medians['tp2']:.1f} tokens/s, "
                  f"tp2/tp1 {rows[-1]['tp2_over_tp1']:.3f}, tp2's collectives "
                  f"{rows[-1]['tp2_median_collective_share']:.1%} of its time (waiting for the other rank "
                  f"{rows[-1]['tp2_median_collective_wait_share']:.1%})", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    results = {"command": "python -m benchmarks.bench_tensor_parallel " + " ".join(sys.argv[1:]),
               "machine": {"cpu": cpu_name(), "platform": platform.platform()}, "cores": cores,
               "model": args.model, "weight_dtype": args.weight_dtype,
               "activation_dtype": args.activation_dtype,
               "engines": {"tp1": f"tensor_parallel_size 1, {cores} threads",
                           "tp2": f"tensor_parallel_size 2, {cores // 2} thread(s) a rank"},
               "samples": args.samples, "steps": args.steps, "date": time.strftime("%Y-%m-%d %H:%M"),
               "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
