"""What LoRA adapters cost at decode: a batch of 16 on a TinyLlama-1.1B-shaped random checkpoint, with 0 (the
base model alone), 1, 4 and 16 distinct rank-16 adapters on all seven modules, per weight dtype; then the
crossover of the merged path: a step of 16 base decode rows and n prefill rows of one adapter, with the
adapter's rows low-rank or on its merged copy (a second pass over the projections).

One engine process per weight dtype (benchmarks/lora_worker.py) holds every adapter in its slots
(max_loras=16); the conditions alternate sample by sample inside each process, and the processes
alternate too (the order flipping every sample), so bandwidth drifts hit every condition alike. Medians
and ratios to the base model come from one run. The adapters are random PEFT-format directories, built
once and cached beside the checkpoint.

    python -m benchmarks.bench_lora [--dtypes q8_0,bfloat16] [--samples 5] [--steps 16]

Writes benchmarks/results/lora.json and lora.png.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from benchmarks.bench_decode import CLEAN_ENV
from benchmarks.checkpoints import CACHE, random_checkpoint
from benchmarks.engine_process import EngineProcess
from models.lora.config import MODULES, module_key, module_shapes  # plain Python: this parent loads no engine
from models.model_spec import load_spec

RESULTS = Path(__file__).parent / "results"
BATCH, PROMPT_LEN, RANK = 16, 16, 16
CONDITIONS = (0, 1, 4, 16)  # distinct adapters in the batch
CROSSOVER_ROWS = (1, 4, 16, 64, 256)  # one adapter's rows in a step, beside BATCH base decode rows


def random_adapters(name: str, num: int, rank: int) -> list[Path]:
    """num random PEFT LoRA directories of this rank on every module of checkpoint `name` (cached)."""
    spec = load_spec(random_checkpoint(name))
    dims = module_shapes(spec)  # module -> (out, in)
    dirs = []
    for i in range(num):
        directory = CACHE / f"{name}-lora-r{rank}-{i}"
        dirs.append(directory)
        if (directory / "adapter_model.safetensors").exists():
            continue
        directory.mkdir(parents=True, exist_ok=True)
        rng = np.random.default_rng(1000 + i)
        tensors = {}
        for layer in range(spec.num_layers):
            for module in MODULES:
                out_features, in_features = dims[module]
                key = f"base_model.model.{module_key(layer, module)}"
                tensors[f"{key}.lora_A.weight"] = (rng.standard_normal((rank, in_features), np.float32)
                                                   / in_features ** .5)
                tensors[f"{key}.lora_B.weight"] = rng.standard_normal((out_features, rank), np.float32) * 0.01
        save_file(tensors, directory / "adapter_model.safetensors")
        (directory / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(MODULES),
             "bias": "none", "task_type": "CAUSAL_LM"}))
    return dirs


def measure_crossover(workers: dict, samples: int) -> list[dict]:
    """One step of BATCH base decode rows and n prefill rows of one adapter, its rows low-rank ("never") or
    on its merged copy ("always", built by an untimed first step), alternating; -> a row per (dtype, n)."""
    for w in workers.values():
        w.call("mixed_step", num_rows=1, merge="always", num_base=BATCH)  # builds the merged copy
    seconds = {(d, n, m): [] for d in workers for n in CROSSOVER_ROWS for m in ("never", "always")}
    for sample in range(samples):
        for n in CROSSOVER_ROWS:
            for merge in (("never", "always") if sample % 2 == 0 else ("always", "never")):
                for dtype, w in workers.items():
                    seconds[(dtype, n, merge)].append(w.call("mixed_step", num_rows=n, merge=merge,
                                                             num_base=BATCH))
    rows = []
    for dtype in workers:
        for n in CROSSOVER_ROWS:
            lowrank, merged = (statistics.median(seconds[(dtype, n, m)]) for m in ("never", "always"))
            rows.append({"weight_dtype": dtype, "adapter_rows": n, "base_rows": BATCH, "lowrank_s": lowrank,
                         "merged_s": merged, "merged_over_lowrank": merged / lowrank})
            print(f"{dtype:9s} {n:3d} adapter rows + {BATCH} base: low-rank {lowrank * 1e3:6.1f} ms, "
                  f"merged {merged * 1e3:6.1f} ms ({merged / lowrank:.2f}x)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtypes", default="q8_0,bfloat16")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16, help="decode steps timed per sample")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    ckpt = random_checkpoint("tinyllama-1.1b")
    adapters = random_adapters("tinyllama-1.1b", max(CONDITIONS), RANK)
    workers = {}
    for dtype in args.dtypes.split(","):
        argv = [str(ckpt), *map(str, adapters), "--weight-dtype", dtype, "--threads", str(args.threads),
                "--max-loras", str(max(CONDITIONS)), "--max-lora-rank", str(RANK),
                "--max-num-seqs", str(BATCH + 1)]
        workers[dtype] = EngineProcess(f"numaserve {dtype}", "benchmarks.lora_worker", argv, CLEAN_ENV)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, 32000, (BATCH, PROMPT_LEN)).tolist()
    seconds = {d: {c: [] for c in CONDITIONS} for d in workers}
    started = time.time()
    for sample in range(args.samples):
        order = list(CONDITIONS) if sample % 2 == 0 else list(reversed(CONDITIONS))
        for c in order:
            for dtype in (list(workers) if sample % 2 == 0 else list(reversed(workers))):
                seconds[dtype][c].append(workers[dtype].call("decode", prompts=prompts, num_adapters=c,
                                                             num_steps=args.steps))
        print(f"sample {sample + 1}/{args.samples} done ({time.time() - started:.0f} s)", flush=True)
    crossover = measure_crossover(workers, args.samples)
    rows = []
    for dtype, by_condition in seconds.items():
        base = statistics.median(by_condition[0])
        for c, values in by_condition.items():
            median = statistics.median(values)
            rows.append({"weight_dtype": dtype, "num_adapters": c, "tok_s": BATCH * args.steps / median,
                         "ratio_to_base": base / median, "seconds": values})
            print(f"{dtype:9s} {c:2d} adapters: {BATCH * args.steps / median:7.1f} tok/s = "
                  f"{base / median:.3f}x base")
    result = {"command": "python -m benchmarks.bench_lora " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()),
              "date": time.strftime("%Y-%m-%d"), "machine": platform.processor() or platform.machine(),
              "batch": BATCH, "rank": RANK, "modules": list(MODULES), "decode_steps": args.steps,
              "samples": args.samples, "threads": args.threads, "rows": rows, "crossover": crossover,
              "stats": {d: w.call("stats") for d, w in workers.items()}}
    for w in workers.values():
        w.close()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "lora.json").write_text(json.dumps(result, indent=2))
    plot(rows, crossover, RESULTS / "lora.png")


def plot(rows: list[dict], crossover: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.8))
    for dtype in dict.fromkeys(r["weight_dtype"] for r in rows):
        mine = [r for r in rows if r["weight_dtype"] == dtype]
        ax.plot([str(r["num_adapters"]) for r in mine], [r["ratio_to_base"] for r in mine], "o-", label=dtype)
        cross = [r for r in crossover if r["weight_dtype"] == dtype]
        bx.plot([r["adapter_rows"] for r in cross], [r["merged_over_lowrank"] for r in cross], "o-",
                label=dtype)
    ax.axhline(0.95, color="grey", ls="--", lw=0.8, label="goal: 0.95 with 4 adapters")
    ax.set_xlabel(f"distinct rank-{RANK} adapters in a decode batch of {BATCH}")
    ax.set_ylabel("decode tokens/s / base model's")
    ax.set_title("LoRA cost at decode, TinyLlama-1.1B shape")
    ax.legend()
    bx.axhline(1.0, color="grey", ls="--", lw=0.8)
    bx.set_xscale("log", base=2)
    bx.set_xlabel(f"one adapter's rows in a step beside {BATCH} base decode rows")
    bx.set_ylabel("step time merged / low-rank")
    bx.set_title("merged copy vs low-rank path")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
