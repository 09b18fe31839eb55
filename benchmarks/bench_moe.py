"""Mixture-of-experts decode and prefill against llama.cpp on the same weights, and batch 1 against the
bandwidth roofline of the weights a token uses.

A Qwen3-MoE-shaped random checkpoint (benchmarks/checkpoints.py: Qwen3-30B-A3B's layers, hidden 2048, 64
experts of 768 with top 8 renormalised, its 151936-token vocabulary untied; 10 layers: 3.83B parameters,
0.88B active per token, 4.1 GB in q8_0) in Hugging Face's per-expert layout, exported once to a q8_0 GGUF by
numaserve (models.gguf.writer.export_gguf, in a short-lived worker before the timed ones start): both engines
load that file, numaserve with int8 activations (its fast path).

As in bench_decode: each engine in its own long-lived process with its own best settings (numaserve's
threading picked by a trial; llama.cpp's defaults in a clean environment), the same threads, the processes
alternating sample by sample with the order flipping, every sample on prompts of its own, medians and ratios
from one run, one untimed sample per engine and row first. Batch-1 roofline: tokens/s x the bytes a token
reads (its active matrices as numaserve serves them: every projection, each MoE layer's float32 router and
top_k / num_experts of its experts, the LM head; the bf16 K and V it attends to; reported by the numaserve
worker, so this process imports no engine code)
/ the read bandwidth probed between the samples.

    python -m benchmarks.bench_moe [--shape 10l|small] [--samples 5] [--no-llamacpp]

Writes benchmarks/results/moe.json and moe.png.
"""

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_decode import (
    DECODE_PROMPT_LEN,
    NUMASERVE_THREADING,
    alternate,
    fresh_tok_s,
    pick_threading,
    start_llamacpp,
    start_numaserve,
    workloads,
)
from benchmarks.bench_revisions import revision
from benchmarks.checkpoints import CACHE, checkpoint_config, random_checkpoint
from benchmarks.machine import cpu_name

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CHECKPOINTS = {"10l": "qwen3moe-10l", "small": "qwen3moe-small"}  # --shape -> benchmarks/checkpoints.py
WEIGHT_DTYPE, ACTIVATION_DTYPE = "q8_0", "int8"


def llamacpp_gguf(ckpt: Path, args) -> tuple[Path | None, str]:
    """-> (the checkpoint as a q8_0 GGUF, exported once and cached, "") or (None, why llama.cpp cannot
    run)."""
    gguf = CACHE / f"{ckpt.name}-{WEIGHT_DTYPE}.gguf"
    if not gguf.exists():
        # float32 activations: the loaded matrices are the q8_0 blocks themselves, written byte for byte
        exporter = start_numaserve(ckpt, WEIGHT_DTYPE, "float32", args, "tbb")
        try:
            exporter.call("export_gguf", path=str(gguf))
        except RuntimeError as e:
            if "CheckpointError" not in str(e):
                raise
            return None, ("numaserve's GGUF exporter (models.gguf.writer.export_gguf) refuses "
                          f"{ckpt.name}: {str(e).strip().splitlines()[-1]}")
        finally:
            exporter.close()
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama-cpp-python is not installed (pip install -e '.[bench]')"
    return gguf, ""


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results["rows"] if "numaserve_tok_s" in r]
    engines = ["numaserve"] + ["llama.cpp"] * any("llamacpp_tok_s" in r for r in rows)
    fig, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 4))
    for ax, r in zip(np.atleast_1d(axes), rows):
        vals = [r["numaserve_tok_s"], r.get("llamacpp_tok_s", 0)][:len(engines)]
        ax.bar(np.arange(len(engines)), vals, 0.6, color=["C0", "C1"][:len(engines)])
        for i, name in enumerate(("numaserve", "llamacpp")[:len(engines)]):
            notes = [f"{r['ratio']:.2f}x llama.cpp"] if "ratio" in r and i == 0 else []
            if f"{name}_of_roofline" in r:
                notes.append(f"{r[f'{name}_of_roofline']:.0%} of roofline")
            ax.annotate("\n".join(notes), (i, vals[i]), ha="center", va="bottom", fontsize=8)
        if "roofline_tok_s" in r:
            ax.axhline(r["roofline_tok_s"], color="k", linestyle="--", linewidth=1)
            ax.annotate(f"roofline: {r['bytes_per_token'] / 1e9:.2f} GB/token at "
                        f"{r['read_bytes_per_s'] / 1e9:.0f} GB/s", (0.5, r["roofline_tok_s"]), ha="center",
                        va="bottom", fontsize=7, xycoords=("axes fraction", "data"))
        ax.set_ylim(0, 1.2 * max(r.get("roofline_tok_s", 0), *vals))
        ax.set_xticks(np.arange(len(engines)), engines)
        title = r["metric"].replace("decode_b", "decode, batch ").replace("prefill", "prefill, 512 tokens")
        ax.set_title(title, fontsize=10)
        ax.set_ylabel("tokens/s (median)")
    meta = results["meta"]
    missing = "" if len(engines) > 1 else "\nno llama.cpp rows: why in the JSON's meta.llamacpp"
    fig.suptitle(f"{meta['checkpoint']} (q8_0; numaserve int8 activations), {meta['cpu']}, "
                 f"{meta['threads']} threads{missing}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="10l", choices=list(CHECKPOINTS),
                        help="10l: 10 Qwen3-30B-A3B layers; small: 4 layers of 16 experts (a smoke test)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--samples", type=int, default=5, help="timed samples per engine and row")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per batch-1 sample")
    parser.add_argument("--batched-steps", type=int, default=32, help="decode steps per batched sample")
    parser.add_argument("--batches", default="8,32", type=lambda s: [int(b) for b in s.split(",")],
                        help="batch sizes besides 1, comma-separated (8 among them for the threading trial)")
    parser.add_argument("--numaserve-threading", default="auto", choices=["auto", *NUMASERVE_THREADING],
                        help="numaserve's threading layer; auto: the faster in a short trial")
    parser.add_argument("--no-llamacpp", action="store_true", help="numaserve only")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe.json")
    args = parser.parse_args()
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"  # this process's probes; the engines get CLEAN_ENV
    from benchmarks.machine import MachineProbe

    ckpt = random_checkpoint(CHECKPOINTS[args.shape])
    vocab_size = checkpoint_config(ckpt.name)["vocab_size"]
    probe = MachineProbe()
    machine = {"read_bytes_per_s": probe.read_bandwidth(repeats=5),
               "matmul_flop_per_s": probe.matmul_flops(repeats=5)}
    print(json.dumps(machine), flush=True)
    gguf, skipped = (None, "--no-llamacpp") if args.no_llamacpp else llamacpp_gguf(ckpt, args)
    if skipped:
        print(f"llama.cpp rows skipped: {skipped}", flush=True)
    rng = np.random.default_rng(0)
    threading, trial = pick_threading(ckpt, WEIGHT_DTYPE, ACTIVATION_DTYPE, args, workloads(args, rng))
    meta = {"command": "python -m benchmarks.bench_moe " + " ".join(sys.argv[1:]), "revision": revision(ROOT),
            "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(), "checkpoint": ckpt.name,
            "config": checkpoint_config(ckpt.name),
            "threads": args.threads, "samples": args.samples, "decode_tokens": args.decode_tokens,
            "batched_steps": args.batched_steps, "llamacpp": skipped or str(gguf),
            "numaserve_settings": {"weight_dtype": WEIGHT_DTYPE, "activation_dtype": ACTIVATION_DTYPE,
                                   "threading": threading, "env": NUMASERVE_THREADING[threading],
                                   "trial": trial, "kv_dtype": "bfloat16", "max_num_batched_tokens": 512},
            "llamacpp_settings": {"env": "the parent's without OMP_*/GOMP_*/KMP_*/NUMBA_THREADING*",
                                  "n_threads": args.threads, "n_threads_batch": args.threads, "mmap": False,
                                  "n_batch": 512, "kv_unified": True, "other": "llama.cpp defaults"}}
    # the same GGUF for both when there is one (its q8_0 blocks: what numaserve quantizes the checkpoint to)
    engines = {"numaserve": start_numaserve(gguf or ckpt, WEIGHT_DTYPE, ACTIVATION_DTYPE, args, threading)}
    rows = []
    try:
        if gguf:
            engines["llama.cpp"] = start_llamacpp(gguf, args)
        info = engines["numaserve"].call("info")
        meta |= {"total_params": info["num_params"], "active_params": info["active_params"]}
        for metric in ["decode_b1", *(f"decode_b{b}" for b in args.batches), "prefill"]:
            runs = {name: fresh_tok_s(e, metric, args, rng, vocab_size) for name, e in engines.items()}
            for run in runs.values():  # untimed
                run()
            if metric == "decode_b1":
                runs["read_bytes_per_s"] = probe.read_bandwidth
            times = alternate(args.samples, runs)
            row = {"metric": metric, "numaserve_tok_s": statistics.median(times["numaserve"]),
                   "samples": times}
            if "llama.cpp" in times:
                row["llamacpp_tok_s"] = statistics.median(times["llama.cpp"])
                row["ratio"] = row["numaserve_tok_s"] / row["llamacpp_tok_s"]
            if metric == "decode_b1":
                bandwidth = statistics.median(times["read_bytes_per_s"])
                # the active matrices as served (the routers float32) and the bf16 K and V a token attends to
                context = DECODE_PROMPT_LEN + (args.decode_tokens + 1) / 2
                per_token = info["active_bytes"] + info["kv_bytes_per_position"] * context
                row |= {"read_bytes_per_s": bandwidth, "bytes_per_token": per_token,
                        "roofline_tok_s": bandwidth / per_token}
                for name, key in (("numaserve", "numaserve_tok_s"), ("llamacpp", "llamacpp_tok_s")):
                    if key in row:
                        row[f"{name}_of_roofline"] = row[key] / row["roofline_tok_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
        for name, e in engines.items():
            memory = {"metric": "memory", "engine": name, "peak_rss_bytes": e.call("peak_rss")}
            keys = ("weight_bytes", "rss_delta_bytes", "threading", "activation_dtypes")
            memory |= {k: info[k] for k in keys} if name == "numaserve" else e.call("info")
            rows.append(memory)
    finally:
        for e in engines.values():
            e.close()
    results = {"meta": meta, "machine": machine, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
