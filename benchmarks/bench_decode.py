"""Decode and prefill speed per weight dtype on a TinyLlama-1.1B-shaped random checkpoint, against
llama.cpp on the same weights (exported to GGUF) with the same threads, engines alternating sample by
sample; fractions of the machine's bandwidth and compute rooflines, the probes sampled between the engines'
samples (bandwidth drifts up to 2x within seconds: a probe taken once misstates the fraction).

    python -m benchmarks.bench_decode [--dtypes bfloat16,q8_0,q4_0] [--samples 3]   (or: numaserve bench)

Writes benchmarks/results/decode.json and decode.png.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import time
from pathlib import Path

import numpy as np
import psutil

import numaserve as ns
from benchmarks.checkpoints import CACHE, random_checkpoint
from benchmarks.machine import MachineProbe

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN, DECODE_PROMPT_LEN = 512, 16


def numaserve_prefill(llm: ns.LLM, prompt: list[int]) -> float:
    engine = llm.engine
    salt = str(time.monotonic_ns())  # a fresh cache salt: every sample computes the whole prompt
    start = time.perf_counter()
    engine.add_request(f"prefill-{salt}", prompt, ns.SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def numaserve_decode(llm: ns.LLM, prompts: list[list[int]], num_steps: int) -> tuple[float, list[list[int]]]:
    """Greedy decode of every prompt at once; -> (seconds of the decode-only steps, tokens)."""
    engine = llm.engine
    params = ns.SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
    reqs = [engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start, [r.output_token_ids for r in reqs]


def alternate(samples: int, runs: dict) -> dict[str, list[float]]:
    """Each run once per sample, the order flipping every sample (bandwidth drifts within seconds)."""
    times = {name: [] for name in runs}
    names = list(runs)
    for s in range(samples):
        for name in (names if s % 2 == 0 else names[::-1]):
            times[name].append(runs[name]())
    return times


def bench_dtype(ckpt: Path, dtype: str, args, rng, probe: MachineProbe) -> list[dict]:
    rss_before = psutil.Process().memory_info().rss
    llm = ns.LLM(ckpt, weight_dtype=dtype, kv_dtype="bfloat16", max_num_seqs=max(args.batches),
                 max_num_batched_tokens=512, num_threads=args.threads)
    rss_weights = psutil.Process().memory_info().rss - rss_before
    model = llm.engine.model
    num_params = sum(np.prod(m.shape) for m in _matrices(model.weights))
    read_bytes = model.weight_bytes - model.weights["embed"].nbytes  # a step reads only T embedding rows
    runs_ours = {}
    runs_theirs = {}
    runner = None
    if not args.no_llamacpp:
        from benchmarks.llamacpp_runner import LlamaCppRunner
        from models.gguf_writer import export_gguf

        gguf_path = CACHE / f"{ckpt.name}-{dtype}.gguf"
        if not gguf_path.exists():
            export_gguf(model.spec, model.weights, llm.tokenizer, gguf_path)
        runner = LlamaCppRunner(gguf_path, threads=args.threads,
                                n_ctx=max(args.batches) * (DECODE_PROMPT_LEN + args.decode_tokens + 8) + PROMPT_LEN,
                                n_seq_max=max(args.batches))
    prompt = rng.integers(3, 32000, PROMPT_LEN).tolist()
    runs_ours["prefill"] = lambda: PROMPT_LEN / numaserve_prefill(llm, prompt)
    if runner:
        runs_theirs["prefill"] = lambda: PROMPT_LEN / runner.prefill(prompt)
    for batch in (1, *args.batches):
        prompts = [rng.integers(3, 32000, DECODE_PROMPT_LEN).tolist() for _ in range(batch)]
        steps = args.decode_tokens if batch == 1 else args.batched_steps
        runs_ours[f"decode_b{batch}"] = lambda p=prompts, n=steps: len(p) * n / numaserve_decode(llm, p, n)[0]
        if runner:
            runs_theirs[f"decode_b{batch}"] = lambda p=prompts, n=steps: len(p) * n / runner.decode(p, n)[0]
    numaserve_decode(llm, [prompt[:16]] * 2, 2)  # warm-up: numba compiles every kernel signature once
    rows = []
    for name, ours_run in runs_ours.items():
        pair = {"numaserve": ours_run} | ({"llama.cpp": runs_theirs[name]} if runner else {})
        if name == "decode_b1":
            pair["read_bytes_per_s"] = probe.read_bandwidth
        elif name.startswith("decode_b"):
            pair["matmul_flop_per_s"] = probe.matmul_flops
        times = alternate(args.samples, pair)
        ours = statistics.median(times["numaserve"])
        row = {"dtype": dtype, "metric": name, "numaserve_tok_s": ours, "samples": times}
        if runner:
            theirs = statistics.median(times["llama.cpp"])
            row |= {"llamacpp_tok_s": theirs, "ratio": ours / theirs}
        if "read_bytes_per_s" in times:
            row["read_bytes_per_s"] = statistics.median(times["read_bytes_per_s"])
            row["bandwidth_roofline"] = ours * read_bytes / row["read_bytes_per_s"]
        elif "matmul_flop_per_s" in times:
            row["matmul_flop_per_s"] = statistics.median(times["matmul_flop_per_s"])
            row["compute_roofline"] = ours * 2 * num_params / row["matmul_flop_per_s"]
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
    rows.append({"dtype": dtype, "metric": "memory", "weight_bytes": model.weight_bytes,
                 "bytes_per_param": model.weight_bytes / num_params, "rss_delta_bytes": rss_weights})
    if runner:
        runner.close()
    return rows


def _matrices(weights: dict):
    yield weights["embed"]
    if weights["lm_head"] is not weights["embed"]:
        yield weights["lm_head"]
    for layer in weights["layers"]:
        yield from (layer[k] for k in ("qkv", "o", "gate_up", "down"))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = list(dict.fromkeys(r["metric"] for r in rows if r["metric"] != "memory"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3.6))
    for ax, metric in zip(np.atleast_1d(axes), metrics):
        sel = [r for r in rows if r["metric"] == metric]
        dtypes = [r["dtype"] for r in sel]
        x = np.arange(len(dtypes))
        ax.bar(x - 0.2, [r["numaserve_tok_s"] for r in sel], 0.4, label="numaserve")
        if "llamacpp_tok_s" in sel[0]:
            ax.bar(x + 0.2, [r["llamacpp_tok_s"] for r in sel], 0.4, label="llama.cpp")
        ax.set_xticks(x, dtypes)
        ax.set_title(metric)
        ax.set_ylabel("tokens/s")
    np.atleast_1d(axes)[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--dtypes", default="bfloat16,q8_0,q4_0")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--batched-steps", type=int, default=32)
    parser.add_argument("--batches", default="8,32", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--no-llamacpp", action="store_true")
    parser.add_argument("--out", default=str(RESULTS / "decode.json"))
    args = parser.parse_args(argv)
    ckpt = random_checkpoint(args.model)
    probe = MachineProbe()
    machine = {"read_bytes_per_s": probe.read_bandwidth(repeats=5), "matmul_flop_per_s": probe.matmul_flops(repeats=5)}
    print(json.dumps(machine), flush=True)  # best of 5 at the start; each row keeps the median of its own probes
    rng = np.random.default_rng(0)
    rows = []
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    for dtype in args.dtypes.split(","):
        rows += bench_dtype(ckpt, dtype, args, rng, probe)
        meta = {"model": args.model, "threads": args.threads, "samples": args.samples,
                "cpu": platform.processor(), "date": time.strftime("%Y-%m-%d %H:%M"),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        out.write_text(json.dumps({"meta": meta, "machine": machine, "rows": rows}, indent=2))  # after each dtype
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
