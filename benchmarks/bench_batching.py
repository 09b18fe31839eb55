"""Aggregate decode tokens/s of one engine at 1, 4, 16 and 64 concurrent requests, and KV utilization.

    python -m benchmarks.bench_batching [--model llama-56m] [--prompt-len 128] [--max-tokens 128]

Writes benchmarks/results/batching.json and batching.png.
"""

import argparse
import json
import platform
import time
from pathlib import Path

import numpy as np

import numaserve as ns
from benchmarks.checkpoints import random_checkpoint

RESULTS = Path(__file__).parent / "results"


def run_level(llm: ns.LLM, concurrency: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    engine = llm.engine
    rng = np.random.default_rng(seed)
    params = ns.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(f"c{concurrency}-{i}", rng.integers(3, 32000, prompt_len).tolist(), params)
    decode_tokens, decode_seconds, utilization, batch_sizes = 0, 0.0, [], []
    while engine.has_unfinished():
        # tokens stored / slots allocated, as the step starts
        kv_utilization = engine.stats()["kv_utilization"]
        start = time.perf_counter()
        step = engine.step()
        elapsed = time.perf_counter() - start
        outputs, stats = step.outputs, step.stats
        if stats.num_decode_tokens and not stats.num_prefill_tokens and not stats.num_waiting and outputs:
            decode_tokens += sum(len(o.token_ids) for o in outputs)
            decode_seconds += elapsed
            batch_sizes.append(len(outputs))
            utilization.append(kv_utilization)
    return {"concurrency": concurrency, "decode_tokens_per_s": decode_tokens / decode_seconds,
            "mean_batch": float(np.mean(batch_sizes)), "kv_utilization_mean": float(np.mean(utilization)),
            "kv_utilization_min": float(np.min(utilization))}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["concurrency"] for r in rows]
    ax.plot(xs, [r["decode_tokens_per_s"] for r in rows], "o-")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("aggregate decode tokens/s")
    ax.set_title("numaserve continuous batching")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama-56m")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--levels", default="1,4,16,64")
    args = parser.parse_args()
    llm = ns.LLM(random_checkpoint(args.model), max_num_seqs=64, max_num_batched_tokens=512)
    run_level(llm, 2, 16, 4, seed=0)  # warm-up: numba compiles every kernel signature once
    rows = []
    for c in (int(x) for x in args.levels.split(",")):
        row = run_level(llm, c, args.prompt_len, args.max_tokens, seed=c)
        print(json.dumps(row))
        rows.append(row)
    RESULTS.mkdir(exist_ok=True)
    meta = {"model": args.model, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
            "weight_dtype": llm.engine.model.weight_dtype, "kv_dtype": llm.config.resolved_kv_dtype,
            "block_size": llm.config.block_size, "cpu": platform.processor() or platform.machine(),
            "threads": llm.engine.config.num_threads, "date": time.strftime("%Y-%m-%d")}
    (RESULTS / "batching.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, RESULTS / "batching.png")


if __name__ == "__main__":
    main()
