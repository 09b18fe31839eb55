"""Prefill speed by chunk size (the step's token budget, `max_num_batched_tokens`) as a fraction of this CPU's
dot-product peak: what the default chunk is chosen from.

One engine per weight format (TinyLlama-1.1B shape, random weights), a prompt of --prompt-len fresh random
tokens per sample prefilled to its first token with the token budget set to each chunk size; the chunk sizes
alternate sample by sample (the order flipping every round: the VM's speed swings within seconds), the peak of
the format's activations (benchmarks/machine.py MachineProbe.dot_peak) sampled between rounds. A row's
operations are its matrix products' (2 x the multiplied weights x the prompt's tokens; attention not counted),
so a fraction is of what the GEMMs could do. The pick is the smallest chunk whose median rate is within
--within of the best chunk's.

    python -m benchmarks.bench_chunks [--chunks 32,64,128,256,512,1024,2048] [--prompt-len 2048] [--samples 3]

Writes benchmarks/results/chunks.json and chunks.png.
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

import numaserve as ns
from benchmarks.bench_revisions import revision
from benchmarks.checkpoints import random_checkpoint
from benchmarks.machine import MachineProbe, cpu_name
from benchmarks.numaserve_worker import matmul_params
from scheduling.policy import Policy

RESULTS = Path(__file__).parent / "results"
# (weight dtype, activation dtype, the peak's kind)
FORMATS = {"q8_0": ("q8_0", "int8", "int8"), "q4_k_m": ("q4_k_m", "int8", "int8"),
           "bfloat16": ("bfloat16", "bfloat16", "bf16")}


def prefill_seconds(llm, prompt: list[int], chunk: int) -> float:
    engine = llm.engine
    engine.apply(Policy(chunk, 1, 1))
    start = time.perf_counter()
    params = ns.SamplingParams(max_tokens=1, temperature=0)
    engine.add_request(f"chunks-{time.monotonic_ns()}", prompt, params)
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def run_format(name: str, args, probe: MachineProbe, rng) -> dict:
    weight_dtype, activation_dtype, kind = FORMATS[name]
    llm = ns.LLM(random_checkpoint(args.model), weight_dtype=weight_dtype, activation_dtype=activation_dtype,
                 max_num_seqs=1, max_num_batched_tokens=max(args.chunks), max_model_len=args.prompt_len + 8,
                 num_threads=args.threads)
    vocab = llm.engine.spec.vocab_size
    params = matmul_params(llm.engine.model.weights)

    def fresh() -> list[int]:  # a new prompt every sample: no prompt cache hit
        return rng.integers(3, vocab, args.prompt_len).tolist()

    prefill_seconds(llm, fresh(), max(args.chunks))  # compiles every kernel the samples run
    times = {c: [] for c in args.chunks}
    peaks = [probe.dot_peak(kind)]
    for s in range(args.samples):
        for c in (args.chunks if s % 2 == 0 else args.chunks[::-1]):
            times[c].append(prefill_seconds(llm, fresh(), c))
        peaks.append(probe.dot_peak(kind))
    peak = statistics.median(peaks)
    rows = []
    for c in args.chunks:
        tok_s = args.prompt_len / statistics.median(times[c])
        rows.append({"chunk": c, "tokens_per_s": tok_s, "matmul_ops_per_s": 2 * params * tok_s,
                     "fraction_of_peak": 2 * params * tok_s / peak, "samples_s": times[c]})
    best = max(r["tokens_per_s"] for r in rows)
    pick = min(r["chunk"] for r in rows if r["tokens_per_s"] >= (1 - args.within) * best)
    del llm
    return {"format": name, "weight_dtype": weight_dtype, "activation_dtype": activation_dtype,
            "peak_kind": kind, "peak_ops_per_s": peak, "peak_samples": peaks, "matmul_params": params,
            "rows": rows, "pick": pick}


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for f in result["formats"]:
        chunks = [r["chunk"] for r in f["rows"]]
        ax.plot(chunks, [100 * r["fraction_of_peak"] for r in f["rows"]], marker="o",
                label=f"{f['format']} ({f['peak_kind']} peak); pick {f['pick']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("chunk (tokens per step)")
    ax.set_ylabel("% of the dot-product peak (matmuls)")
    ax.set_title(f"prefill of {result['prompt_len']} tokens, {result['threads']} threads, {result['cpu']}",
                 fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--formats", default="q8_0,bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--chunks", default="32,64,128,256,512,1024,2048",
                        type=lambda s: [int(c) for c in s.split(",")])
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--within", type=float, default=0.05, help="the pick: within this of the best rate")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--out", default=str(RESULTS / "chunks.json"))
    args = parser.parse_args()
    import numba
    numba.set_num_threads(args.threads)
    probe, rng = MachineProbe(), np.random.default_rng(time.monotonic_ns())
    result = {"command": "python -m benchmarks.bench_chunks " + " ".join(sys.argv[1:]),
              "revision": revision(Path(__file__).resolve().parent.parent), "cpu": cpu_name(),
              "machine": platform.machine(), "threads": args.threads, "prompt_len": args.prompt_len,
              "samples": args.samples, "within": args.within,
              "formats": [run_format(f, args, probe, rng) for f in args.formats
                          if probe.has_peak(FORMATS[f][2])]}  # a CPU without vdpbf16ps runs bf16 in float32
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    for f in result["formats"]:
        rates = {r["chunk"]: f"{r['tokens_per_s']:.0f} tok/s {100 * r['fraction_of_peak']:.0f}%"
                 for r in f["rows"]}
        print(f["format"], "pick", f["pick"], rates)


if __name__ == "__main__":
    main()
