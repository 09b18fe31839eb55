"""Long-context speed: decode at batch 1 and 8 over 1k and 4k positions of context and the prefill of
4 x 1k-token prompts, numaserve with each KV dtype against llama.cpp with each of its KV types (flash
attention on), on the TinyLlama shape's random checkpoint in q8_0 (benchmarks/checkpoints.py; llama.cpp reads
the same weights exported to GGUF).

Engines run in processes of their own (benchmarks/numaserve_worker.py, benchmarks/llamacpp_runner.py), one
group of equal KV bytes per value at a time (bf16 / f16: 2; int8, fp8_e4m3 / q8_0: 1 + 1/16; int4_hadamard /
q4_0: 1/2 + 1/16, at head_dim 64), alternating sample by sample with the order flipping; every prefill sample
draws prompts of its own (no prefix cache serves one from another). Each numaserve row's ratio is against the
llama.cpp KV type of its group. One untimed round first: numba compiles or loads each kernel, the processes
touch their KV pages. A decode row's context is prefilled once per engine (untimed, prompts of its own) and
each sample times the next `--decode-steps` steps of it, so the context grows by that much a sample.

    python -m benchmarks.bench_context [--contexts 1024,4096] [--samples 3] [--threads N]
    NUMASERVE_BENCH_SHORT=1 python -m benchmarks.bench_context     (a smoke run: small model, short contexts)

Writes benchmarks/results/context.json and context.png.
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_decode import CLEAN_ENV, alternate
from benchmarks.checkpoints import CACHE, random_checkpoint
from benchmarks.engine_process import EngineProcess
from benchmarks.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
# each group: numaserve KV dtypes and the llama.cpp KV type of the same bytes per value
GROUPS = {"f16": ("bfloat16",), "q8_0": ("int8", "fp8_e4m3"), "q4_0": ("int4_hadamard",)}
SHORT = os.environ.get("NUMASERVE_BENCH_SHORT") == "1"
WARM_STEPS = 4  # untimed decode steps after a context's prefill (the first steps touch new KV pages)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama-56m" if SHORT else "tinyllama-1.1b",
                        help="random checkpoint shape (benchmarks/checkpoints.py)")
    parser.add_argument("--weight-dtype", default="q8_0", help="both engines' weights")
    parser.add_argument("--activation-dtype", default="int8",
                        help="numaserve activations (int8: fastest with q8_0 weights, `numaserve bench`)")
    parser.add_argument("--contexts", default="64,128" if SHORT else "1024,4096",
                        type=lambda s: [int(c) for c in s.split(",")], help="context lengths of the decodes")
    parser.add_argument("--batches", default="1,8", type=lambda s: [int(b) for b in s.split(",")],
                        help="decode batch sizes")
    parser.add_argument("--prefill", default="4x64" if SHORT else "4x1024",
                        help="prompts x tokens prefilled together")
    parser.add_argument("--decode-steps", type=int, default=4 if SHORT else 64, help="decode steps a sample")
    parser.add_argument("--samples", type=int, default=1 if SHORT else 3, help="timed samples per engine")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of each engine (unless given: every core this process may run on)")
    parser.add_argument("--groups", default=",".join(GROUPS), help="llama.cpp KV types whose groups run")
    parser.add_argument("--out", default=str(RESULTS / "context.json"),
                        help="JSON to write (and the PNG beside it)")
    return parser


def workloads(args) -> dict[str, tuple[str, int, int]]:
    """metric -> (command, prompts, tokens a prompt); decode metrics time decode_steps steps."""
    num_prompts, prompt_tokens = (int(x) for x in args.prefill.split("x"))
    loads = {f"prefill_{args.prefill}": ("prefill_batch", num_prompts, prompt_tokens)}
    for context in args.contexts:
        for batch in args.batches:
            loads[f"decode_b{batch}_ctx{context}"] = ("decode", batch, context)
    return loads


def start_engines(ckpt: Path, gguf: Path, llamacpp_type: str, args) -> dict[str, EngineProcess]:
    # the workers' warm-ups decode 2 prompts at once (llama.cpp fails a sequence past n_seq_max)
    num_seqs = max(2, max(args.batches), int(args.prefill.split("x")[0]))
    # a decode context grows by decode_steps every sample (and WARM_STEPS before them)
    longest = (max(max(args.contexts), int(args.prefill.split("x")[1]))
               + args.decode_steps * args.samples + WARM_STEPS + 8)
    engines = {}
    for kv_dtype in GROUPS[llamacpp_type]:
        argv = [str(ckpt), "--weight-dtype", args.weight_dtype, "--activation-dtype", args.activation_dtype,
                "--kv-dtype", kv_dtype, "--threads",
                str(args.threads), "--max-num-seqs", str(num_seqs), "--max-num-batched-tokens", "1024",
                "--max-model-len", str(longest), "--kv-cache-bytes", str(4 << 30)]
        name = f"numaserve {kv_dtype}"
        engines[name] = EngineProcess(name, "benchmarks.numaserve_worker", argv, CLEAN_ENV)
    argv = [str(gguf), "--threads", str(args.threads), "--n-ctx", str(num_seqs * longest), "--n-seq-max",
            str(num_seqs), "--kv-type", llamacpp_type]
    engines[f"llama.cpp {llamacpp_type}"] = EngineProcess(f"llama.cpp {llamacpp_type}",
                                                          "benchmarks.llamacpp_runner", argv, CLEAN_ENV)
    return engines


def sampler(engine: EngineProcess, load: tuple[str, int, int], args, rng, vocab_size: int):
    """One timed sample -> (tokens/s, seconds). A prefill sample runs prompts drawn for it alone; a decode
    sample times decode_steps more steps of the engine's open context (open_context)."""
    cmd, num_prompts, prompt_tokens = load

    def sample() -> tuple[float, float]:
        if cmd == "prefill_batch":
            prompts = rng.integers(3, vocab_size, (num_prompts, prompt_tokens)).tolist()
            seconds = engine.call(cmd, prompts=prompts)
            return num_prompts * prompt_tokens / seconds, seconds
        seconds = engine.call("decode_more", num_steps=args.decode_steps)
        return num_prompts * args.decode_steps / seconds, seconds
    return sample


def open_context(engine: EngineProcess, load: tuple[str, int, int], rng, vocab_size: int) -> None:
    """A decode load's context, prefilled once (untimed) on prompts drawn for this engine: every sample then
    decodes on from it (prefilling 8 x 4k tokens per sample and engine would take most of the run; what a
    decode step costs depends on the context's length, not its tokens)."""
    _, num_prompts, prompt_tokens = load
    engine.call("open_decode", prompts=rng.integers(3, vocab_size, (num_prompts, prompt_tokens)).tolist())
    engine.call("decode_more", num_steps=WARM_STEPS)


def bench_group(llamacpp_type: str, ckpt: Path, gguf: Path, args, loads: dict, vocab_size: int) -> list[dict]:
    engines = start_engines(ckpt, gguf, llamacpp_type, args)
    rng = np.random.default_rng(len(llamacpp_type))
    rows = []
    for metric, load in loads.items():
        runs = {name: sampler(e, load, args, rng, vocab_size) for name, e in engines.items()}
        for name, run in runs.items():  # untimed
            if load[0] == "decode":
                open_context(engines[name], load, rng, vocab_size)
            else:
                run()
        samples = alternate(args.samples, runs)
        if load[0] == "decode":
            for e in engines.values():
                e.call("close_decode")
        theirs = statistics.median(s[0] for s in samples[f"llama.cpp {llamacpp_type}"])
        for name, values in samples.items():
            row = {"metric": metric, "engine": name, "tok_s": statistics.median(v[0] for v in values),
                   "seconds": statistics.median(v[1] for v in values),
                   "samples_tok_s": [v[0] for v in values]}
            if name.startswith("numaserve"):
                row["ratio_to_llamacpp"] = row["tok_s"] / theirs
                row["llamacpp_kv_type"] = llamacpp_type
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "samples_tok_s"}), flush=True)
    for name, e in engines.items():
        rows.append({"metric": "memory", "engine": name, "peak_rss_bytes": e.call("peak_rss")})
        e.close()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [r for r in rows if "tok_s" in r]
    metrics = list(dict.fromkeys(r["metric"] for r in speed))
    engines = list(dict.fromkeys(r["engine"] for r in speed))
    fig, axes = plt.subplots(1, len(metrics), figsize=(3.6 * len(metrics), 4.2))
    for ax, metric in zip(np.atleast_1d(axes), metrics):
        values = {r["engine"]: r["tok_s"] for r in speed if r["metric"] == metric}
        ax.bar(range(len(engines)), [values.get(e, 0) for e in engines],
               color=["tab:blue" if e.startswith("numaserve") else "tab:orange" for e in engines])
        ax.set_xticks(range(len(engines)), [e.replace("numaserve ", "") for e in engines], rotation=60,
                      fontsize=7)
        ax.set_title(metric, fontsize=9)
        ax.set_ylabel("tokens/s")
    fig.suptitle("numaserve KV dtypes (blue) against llama.cpp KV types (orange)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    args = build_parser().parse_args()
    ckpt = random_checkpoint(args.model)
    vocab_size = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    gguf = CACHE / f"{ckpt.name}-{args.weight_dtype}.gguf"
    if not gguf.exists():
        argv = [str(ckpt), "--weight-dtype", args.weight_dtype, "--threads", str(args.threads)]
        exporter = EngineProcess("export", "benchmarks.numaserve_worker", argv, CLEAN_ENV)
        exporter.call("export_gguf", path=str(gguf))
        exporter.close()
    loads = workloads(args)
    meta = {"model": args.model, "weight_dtype": args.weight_dtype,
            "activation_dtype": args.activation_dtype, "threads": args.threads,
            "samples": args.samples, "decode_steps": args.decode_steps, "cpu": cpu_name(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "short_run": SHORT,
            "processes": "one per engine, a group of equal KV bytes per value at a time, alternating",
            "numaserve_settings": {"max_num_batched_tokens": 1024, "threading": "shipped default"},
            "llamacpp_settings": {"flash_attn": True, "n_batch": 512, "kv_unified": True, "mmap": False}}
    rows = []
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    for llamacpp_type in args.groups.split(","):
        rows += bench_group(llamacpp_type, ckpt, gguf, args, loads, vocab_size)
        out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))  # after each group
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
