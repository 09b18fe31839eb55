"""Decode speed of two revisions of numaserve on the same weights: the code of this tree against another
checkout (a refactor must not cost speed).

Each revision's engine runs in its own long-lived process started in its own tree
(benchmarks/numaserve_worker.py of that tree, so it imports that tree's code), with the same threads and
settings; the processes alternate sample by sample, the order flipping every sample, and each row's medians
and ratio come from one run. Every sample decodes prompts of its own (unique token ids), so no prefix cache
serves one sample from another's.

    git worktree add /tmp/numaserve-old <revision>
    python -m benchmarks.bench_revisions --old /tmp/numaserve-old
                                         [--rows demo:bfloat16:16,tinyllama-1.1b:q8_0:1,...]

A row is model:weight_dtype:B, decode at batch B (tokens a second over --steps steps after the prompts'
prefill of --prompt-len tokens each), or model:weight_dtype:prefillN, one prompt of N tokens prefilled to its
first token (its tokens a second). `--kv-dtype int8 --prompt-len 1024` times a KV dtype's attention at a long
context.

Writes benchmarks/results/revisions.json and revisions.png.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import random_checkpoint
from benchmarks.engine_process import EngineProcess
from benchmarks.machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
DEMO = ROOT / "numaserve" / "assets" / "demo" / "base"
DEFAULT_ROWS = "demo:bfloat16:16,tinyllama-1.1b:q8_0:1,tinyllama-1.1b:q8_0:32,tinyllama-1.1b:q8_0:prefill512"


def model_dir(name: str) -> Path:
    return DEMO if name == "demo" else random_checkpoint(name)


def revision(tree: Path) -> str:
    def git(*argv: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *argv], check=True, capture_output=True,
                              text=True).stdout.strip()

    dirty = git("status", "--porcelain", "--untracked-files=no")
    return git("rev-parse", "--short", "HEAD") + (" (uncommitted changes)" if dirty else "")


def start(tree: Path, label: str, model: Path, weight_dtype: str, args) -> EngineProcess:
    argv = [str(model), "--weight-dtype", weight_dtype, "--activation-dtype", args.activation_dtype,
            "--threads", str(args.threads), "--max-num-seqs", str(max(32, args.max_batch)),
            "--kv-dtype", args.kv_dtype]
    return EngineProcess(f"{label} {weight_dtype}", "benchmarks.numaserve_worker", argv, dict(os.environ),
                         cwd=tree)


def sample(engine: EngineProcess, kind: str, rng: np.random.Generator, args) -> float:
    """One timed sample of a row, tokens a second; prompts unique to this sample and engine (no prefix cache
    serves one from another)."""
    if kind.startswith("prefill"):
        tokens = int(kind.removeprefix("prefill"))
        return tokens / engine.call("prefill", prompt=rng.integers(3, 250, tokens).tolist())
    batch = int(kind)
    prompts = rng.integers(3, 250, (batch, args.prompt_len)).tolist()
    return batch * args.steps / engine.call("decode", prompts=prompts, num_steps=args.steps)


def run_model(name: str, weight_dtype: str, batches: list[str], trees: dict[str, Path], args,
              seed: int) -> list[dict]:
    """One row per batch size (or prefill length), on one engine per revision (loaded once for all)."""
    model = model_dir(name)
    engines = {label: start(tree, label, model, weight_dtype, args) for label, tree in trees.items()}
    rng = np.random.default_rng(seed)
    rows = []
    try:
        for batch in batches:
            tokens_per_s: dict[str, list[float]] = {label: [] for label in engines}
            for engine in engines.values():  # untimed: a row's first call compiles what had not been (numba)
                sample(engine, batch, rng, args)
            for i in range(args.samples):
                order = list(engines) if i % 2 == 0 else list(engines)[::-1]
                for label in order:
                    tokens_per_s[label].append(sample(engines[label], batch, rng, args))
            medians = {label: statistics.median(v) for label, v in tokens_per_s.items()}
            rows.append({"model": name, "weight_dtype": weight_dtype,  # batch: a decode batch, or "prefillN"
                         "batch": batch if batch.startswith("prefill") else int(batch),
                         "tokens_per_s": tokens_per_s, "median_tokens_per_s": medians,
                         "new_over_old": medians["new"] / medians["old"]})
            print(f"{name} {weight_dtype} {batch}: old {medians['old']:.1f}, new {medians['new']:.1f} "
                  f"tokens/s, new/old {rows[-1]['new_over_old']:.3f}", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    labels = [f"{r['model']} {r['weight_dtype']}\n"
              + (f"batch {r['batch']}" if isinstance(r["batch"], int) else r["batch"]) for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(2.4 * len(rows) + 2, 4))
    for offset, label in ((-0.2, "old"), (0.2, "new")):
        ax.bar(x + offset, [r["median_tokens_per_s"][label] for r in rows], 0.4,
               label=f"{label}: {results['revisions'][label]}")
    for i, r in enumerate(rows):
        ax.annotate(f"{r['new_over_old']:.3f}x", (i, max(r["median_tokens_per_s"].values())), ha="center",
                    va="bottom")
    ax.set_xticks(x, labels)
    ax.set_ylabel("tokens/s (median): decode, or prefill")
    ax.set_title(f"numaserve revisions, {results['machine']['cpu']}, {results['threads']} threads")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", required=True, type=Path, help="the other revision's tree (a git worktree)")
    parser.add_argument("--rows", default=DEFAULT_ROWS,
                        help="model:weight_dtype:B or model:weight_dtype:prefillN, comma-separated")
    parser.add_argument("--activation-dtype", default="auto", help="as EngineConfig.activation_dtype")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--samples", type=int, default=7, help="timed samples per engine and row")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per sample")
    parser.add_argument("--kv-dtype", default="bfloat16", help="as EngineConfig.kv_cache_dtype")
    parser.add_argument("--prompt-len", type=int, default=16, help="tokens of each decode row's prompts")
    parser.add_argument("--out", type=Path, default=RESULTS / "revisions.json")
    args = parser.parse_args()
    rows = [tuple(row.split(":")) for row in args.rows.split(",")]
    args.max_batch = max((int(b) for *_, b in rows if not b.startswith("prefill")), default=1)
    trees = {"old": args.old.resolve(), "new": ROOT}
    results = {"command": "python -m benchmarks.bench_revisions " + " ".join(sys.argv[1:]),
               "revisions": {label: revision(tree) for label, tree in trees.items()},
               "machine": {"cpu": cpu_name(), "platform": platform.platform()}, "threads": args.threads,
               "samples": args.samples, "steps": args.steps, "kv_dtype": args.kv_dtype,
               "prompt_len": args.prompt_len, "rows": []}
    models = list(dict.fromkeys((m, d) for m, d, _ in rows))  # in order, each once
    for i, (name, dtype) in enumerate(models):
        batches = [b for m, d, b in rows if (m, d) == (name, dtype)]
        results["rows"] += run_model(name, dtype, batches, trees, args, seed=i)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
