"""Decode and prefill speed per weight dtype and activation dtype on a TinyLlama-1.1B-shaped random
checkpoint, against llama.cpp on the same weights (exported to GGUF) with the same threads.

Each engine runs in its own long-lived process (benchmarks/numaserve_worker.py, one per activation dtype;
benchmarks/llamacpp_runner.py) that loads the model once and is timed on command; the processes alternate
sample by sample, the order flipping every sample, and each row's medians and ratio come from one run.
llama.cpp gets a clean environment and its own defaults; numaserve gets its best threading for dedicated
cores, picked by a short trial at the start (its shipped default, numba's tbb layer, against numba's
OpenMP layer with OMP_WAIT_POLICY=ACTIVE). This parent imports neither engine: it only runs the machine
probes, sampled between the engines' samples (bandwidth drifts up to 2x within seconds), on numba's
workqueue layer, whose threads sleep between probes: a batch-1 row is a fraction of the read probe (the
weights' bytes a token reads), a prefill or batched row a fraction of the dot-product peak of its
activation dtype's instructions (benchmarks/bench_peak.py; 2 x the matrices' parameters a token, attention's
own products left out).
A "torch imported first" pair (same weights, numaserve's shipped settings) checks import order.

    python -m benchmarks.bench_decode [--dtypes bfloat16,q8_0,q4_0,q4_k_m]
                                      [--activation-dtypes float32,bfloat16,int8]
                                      [--samples 3]        (or: numaserve bench ...)

Writes benchmarks/results/decode.json (after each weight dtype) and decode.png.
"""

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_revisions import revision
from benchmarks.checkpoints import CACHE, random_checkpoint
from benchmarks.engine_process import EngineProcess
from benchmarks.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
PROMPT_LEN, DECODE_PROMPT_LEN = 512, 16
ENGINE_MODULES = ("kernels", "scheduling.engine", "models.decoder", "numaserve.llm")
# what the engines' processes inherit: no threading settings of anyone's (ours included)
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("OMP_", "GOMP_", "KMP_", "NUMBA_THREADING"))}
NUMASERVE_THREADING = {  # candidates for numaserve's process: extra environment
    "tbb": {},  # the shipped default (kernels/__init__.py)
    "omp-active": {"NUMBA_THREADING_LAYER": "omp", "OMP_WAIT_POLICY": "ACTIVE"},  # spinning waits
}
# the dot-product instructions bounding each activation dtype's prefill and batched rows (bench_peak)
PEAK_KIND = {"int8": "int8", "bfloat16": "bf16", "float32": "f32"}
# activation dtypes meant for each weight dtype (others only with --all-combinations)
MEANT_FOR = {"float32": {"float32", "bfloat16", "q8_0", "q4_0", "q4_k_m", "iq4_xs", "iq4_nl"},
             "bfloat16": {"bfloat16"}, "int8": {"q8_0", "q4_0", "q4_k_m", "iq4_xs", "iq4_nl"}}


def start_numaserve(ckpt: Path, weight_dtype: str, activation_dtype: str, args, threading: str,
                    torch_first: bool = False) -> EngineProcess:
    name = f"numaserve {weight_dtype}/{activation_dtype}" + (" torch-first" if torch_first else "")
    argv = [str(ckpt), "--weight-dtype", weight_dtype, "--activation-dtype", activation_dtype,
            "--threads", str(args.threads), "--max-num-seqs", str(max(args.batches))]
    env = CLEAN_ENV | NUMASERVE_THREADING[threading]
    return EngineProcess(name, "benchmarks.numaserve_worker", argv + ["--torch-first"] * torch_first, env)


def start_llamacpp(gguf: Path, args) -> EngineProcess:
    n_ctx = (max(args.batches) * (DECODE_PROMPT_LEN + max(args.decode_tokens, args.batched_steps) + 8)
             + PROMPT_LEN + max(args.contexts, default=0) + args.decode_tokens)
    argv = [str(gguf), "--threads", str(args.threads), "--n-ctx", str(n_ctx), "--n-seq-max",
            str(max(args.batches))]
    return EngineProcess("llama.cpp", "benchmarks.llamacpp_runner", argv, CLEAN_ENV | llama_cpp_env())


def llama_cpp_env() -> dict[str, str]:
    """llama-cpp-python's libraries: its own, or on a CPU with AMX (where its -march=native build crashed)
    the vendored llama.cpp built without AMX (benchmarks/llama_server.py)."""
    from benchmarks.llama_server import host_has_amx, llama_cpp_library_without_amx

    return {"LLAMA_CPP_LIB_PATH": str(llama_cpp_library_without_amx())} if host_has_amx() else {}


def llama_cpp_build() -> str:
    from benchmarks.llama_server import NO_AMX_FLAGS, host_has_amx

    if not host_has_amx():
        return "llama-cpp-python's own (its build's -march=native)"
    return ("the llama.cpp inside llama-cpp-python built without AMX (its own build crashed in its AMX "
            "matrix multiply on this CPU, llama.cpp issue 20824): " + " ".join(NO_AMX_FLAGS))


def workloads(args, rng) -> dict[str, tuple[str, dict, int]]:
    """metric -> (command, its arguments, tokens it times)."""
    prompt = rng.integers(3, 32000, PROMPT_LEN).tolist()
    loads = {"prefill": ("prefill", {"prompt": prompt}, PROMPT_LEN)}
    for batch in (1, *args.batches):
        steps = args.decode_tokens if batch == 1 else args.batched_steps
        prompts = [rng.integers(3, 32000, DECODE_PROMPT_LEN).tolist() for _ in range(batch)]
        loads[f"decode_b{batch}"] = ("decode", {"prompts": prompts, "num_steps": steps}, batch * steps)
    for context in args.contexts:  # batch 1 over a longer prompt: its attention reads `context` positions
        prompts = [rng.integers(3, 32000, context).tolist()]
        loads[f"decode_b1_ctx{context}"] = ("decode", {"prompts": prompts, "num_steps": args.decode_tokens},
                                            args.decode_tokens)
    return loads


def token_bytes(info: dict, metric: str, args) -> float:
    """Bytes a batch-1 token reads: the weights (not the embedding table) and its context's K and V, at the
    decode's mean position."""
    context = int(metric.removeprefix("decode_b1_ctx")) if "_ctx" in metric else DECODE_PROMPT_LEN
    return info["read_bytes"] + (context + args.decode_tokens / 2) * info["kv_bytes_per_position"]


def is_batch1(metric: str) -> bool:
    """A batch-1 decode row (at 16 tokens of context or at --contexts'): a fraction of the read probe."""
    return metric == "decode_b1" or metric.startswith("decode_b1_ctx")


def alternate(samples: int, runs: dict) -> dict[str, list[float]]:
    """Each run once per sample, the order flipping every sample (bandwidth drifts within seconds)."""
    times = {name: [] for name in runs}
    names = list(runs)
    for s in range(samples):
        for name in (names if s % 2 == 0 else names[::-1]):
            times[name].append(runs[name]())
    return times


def tok_s(engine: EngineProcess, load: tuple[str, dict, int]):
    cmd, kwargs, num_tokens = load
    return lambda: num_tokens / engine.call(cmd, **kwargs)


def fresh_tok_s(engine: EngineProcess, metric: str, args, rng, vocab_size: int):
    """tokens/s of one sample of metric ("prefill" or "decode_b<batch>", as workloads names them) on prompts
    drawn for that sample alone, so no prefix cache serves one sample from another's."""
    def sample() -> float:
        if metric == "prefill":
            return tok_s(engine, ("prefill", {"prompt": rng.integers(3, vocab_size, PROMPT_LEN).tolist()},
                                  PROMPT_LEN))()
        batch = int(metric.removeprefix("decode_b"))
        steps = args.decode_tokens if batch == 1 else args.batched_steps
        prompts = rng.integers(3, vocab_size, (batch, DECODE_PROMPT_LEN)).tolist()
        return tok_s(engine, ("decode", {"prompts": prompts, "num_steps": steps}, batch * steps))()
    return sample


def pick_threading(ckpt: Path, weight_dtype: str, activation_dtype: str, args,
                   loads: dict) -> tuple[str, dict]:
    """numaserve's faster threading on these cores: decode batch 1 and 8, three alternating samples each."""
    if args.numaserve_threading != "auto":
        return args.numaserve_threading, {}
    engines = {t: start_numaserve(ckpt, weight_dtype, activation_dtype, args, t) for t in NUMASERVE_THREADING}
    trial = {}
    for metric in ("decode_b1", "decode_b8"):
        cmd, kwargs, _ = loads[metric]
        kwargs = kwargs | {"num_steps": max(kwargs["num_steps"] // 4, 16)}
        times = alternate(3, {t: tok_s(e, (cmd, kwargs, len(kwargs["prompts"]) * kwargs["num_steps"]))
                              for t, e in engines.items()})
        trial[metric] = {t: statistics.median(v) for t, v in times.items()}
    for e in engines.values():
        e.close()
    best = max(NUMASERVE_THREADING, key=lambda t: sum(math.log(trial[m][t]) for m in trial))
    print(json.dumps({"numaserve_threading_trial": trial, "chosen": best}), flush=True)
    return best, {"weights": weight_dtype, "activations": activation_dtype, "tok_s": trial}


def peak_kind(computed: list[str]) -> str:
    """The dot-product peak a row is a fraction of: that of the activations the engine computed with (a CPU
    without vdpbf16ps computes bfloat16 requests in float32: models/quantization/activation_plan.py); where
    its matrices mixed them, the highest peak of theirs (the smaller fraction)."""
    return min((PEAK_KIND[a] for a in computed), key=("int8", "bf16", "f32").index)


def bench_dtype(ckpt: Path, weight_dtype: str, args, loads: dict, probe, threading: str,
                first: bool) -> list[dict]:
    act_dtypes = [a for a in args.activation_dtypes if args.all_combinations or weight_dtype in MEANT_FOR[a]]
    ours = {a: start_numaserve(ckpt, weight_dtype, a, args, threading) for a in act_dtypes}
    info = {a: e.call("info") for a, e in ours.items()}
    kinds = {a: peak_kind(info[a]["activation_dtypes"]) for a in ours}
    engines = {f"numaserve/{a}": e for a, e in ours.items()}
    if not args.no_llamacpp:
        gguf = CACHE / f"{ckpt.name}-{weight_dtype}.gguf"
        if not gguf.exists():
            next(iter(ours.values())).call("export_gguf", path=str(gguf))
        engines["llama.cpp"] = start_llamacpp(gguf, args)
    rows = []
    for metric, load in loads.items():
        runs = {name: tok_s(e, load) for name, e in engines.items()}
        if is_batch1(metric):
            runs["read_bytes_per_s"] = probe.read_bandwidth
        else:  # prefill and batched decode: the dot-product peak of each activation dtype's instructions
            for kind in set(kinds.values()):
                runs[f"peak_{kind}"] = lambda kind=kind: probe.dot_peak(kind)
        times = alternate(args.samples, runs)
        for a in ours:
            row = {"dtype": weight_dtype, "activation_dtype": a, "metric": metric,
                   "numaserve_tok_s": statistics.median(times[f"numaserve/{a}"]),
                   "samples": {k: v for k, v in times.items() if k in (f"numaserve/{a}", "llama.cpp")}}
            if "llama.cpp" in times:
                row["llamacpp_tok_s"] = statistics.median(times["llama.cpp"])
                row["ratio"] = row["numaserve_tok_s"] / row["llamacpp_tok_s"]
            if "read_bytes_per_s" in times:
                row["read_bytes_per_s"] = statistics.median(times["read_bytes_per_s"])
                row["bytes_per_token"] = token_bytes(info[a], metric, args)
                row["bandwidth_roofline"] = (row["numaserve_tok_s"] * row["bytes_per_token"]
                                             / row["read_bytes_per_s"])
            elif f"peak_{kinds[a]}" in times:
                row["peak_kind"] = kinds[a]
                row["peak_ops_per_s"] = statistics.median(times[f"peak_{kinds[a]}"])
                row["of_peak"] = row["numaserve_tok_s"] * 2 * info[a]["matmul_params"] / row["peak_ops_per_s"]
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "samples"}), flush=True)
    if first and not args.no_torch_first:
        rows += torch_first_rows(ckpt, weight_dtype, act_dtypes[0], args, loads,
                                 ours if threading == "tbb" else {})
    for name, e in engines.items():
        memory = {"dtype": weight_dtype, "metric": "memory", "engine": name,
                  "peak_rss_bytes": e.call("peak_rss")}
        if name.startswith("numaserve/"):
            own = info[name.removeprefix("numaserve/")]
            memory |= {k: own[k]
                       for k in ("weight_bytes", "rss_delta_bytes", "threading", "activation_dtypes")}
            memory["bytes_per_param"] = own["weight_bytes"] / own["num_params"]
        else:
            memory |= e.call("info")  # llama.cpp's threads and system info (its SIMD paths)
        rows.append(memory)
        e.close()
    return rows


def torch_first_rows(ckpt: Path, weight_dtype: str, act_dtype: str, args, loads: dict,
                     running: dict) -> list[dict]:
    """numaserve with its shipped settings, `import torch` first vs not, alternating; ratio to the plain
    one."""
    plain = running.get(act_dtype) or start_numaserve(ckpt, weight_dtype, act_dtype, args, "tbb")
    torch_first = start_numaserve(ckpt, weight_dtype, act_dtype, args, "tbb", torch_first=True)
    threading = {"plain": plain.call("info")["threading"], "torch": torch_first.call("info")["threading"]}
    for engine in (plain, torch_first):  # one untimed round: a fresh process first touches its KV pages
        for metric in ("decode_b1", "decode_b8"):
            engine.call(loads[metric][0], **loads[metric][1])
    rows = []
    for metric in ("decode_b1", "decode_b8"):
        times = alternate(args.samples, {"plain": tok_s(plain, loads[metric]),
                                         "torch": tok_s(torch_first, loads[metric])})
        ours, base = statistics.median(times["torch"]), statistics.median(times["plain"])
        rows.append({"dtype": weight_dtype, "activation_dtype": act_dtype, "metric": f"torch_first_{metric}",
                     "numaserve_tok_s": ours, "plain_tok_s": base, "ratio_to_plain": ours / base,
                     "samples": times, "threading": threading})
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), flush=True)
    torch_first.close()
    if plain is not running.get(act_dtype):
        plain.close()
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    speed = [r for r in rows if "numaserve_tok_s" in r and not r["metric"].startswith("torch_first")]
    metrics = list(dict.fromkeys(r["metric"] for r in speed))
    dtypes = list(dict.fromkeys(r["dtype"] for r in speed))
    acts = list(dict.fromkeys(r["activation_dtype"] for r in speed))
    series = [f"numaserve {a}" for a in acts] + ["llama.cpp"] * any("llamacpp_tok_s" in r for r in speed)
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.8))
    for ax, metric in zip(np.atleast_1d(axes), metrics):
        sel = {(r["dtype"], r["activation_dtype"]): r for r in speed if r["metric"] == metric}
        for i, name in enumerate(series):
            if name == "llama.cpp":
                vals = [next((r["llamacpp_tok_s"] for (d, _), r in sel.items() if d == dt), 0)
                        for dt in dtypes]
            else:
                vals = [sel.get((dt, name.split()[1]), {}).get("numaserve_tok_s", 0) for dt in dtypes]
            ax.bar(np.arange(len(dtypes)) + (i - (len(series) - 1) / 2) * width, vals, width, label=name)
        ax.set_xticks(np.arange(len(dtypes)), dtypes)
        ax.set_title(metric)
        ax.set_ylabel("tokens/s")
    np.atleast_1d(axes)[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="numaserve bench",
                                     description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="tinyllama-1.1b",
                        help="random checkpoint shape (benchmarks/checkpoints.py)")
    parser.add_argument("--dtypes", default="bfloat16,q8_0,q4_0,q4_k_m",
                        help="weight dtypes, comma-separated")
    parser.add_argument("--activation-dtypes", default="float32,bfloat16,int8", type=lambda s: s.split(","),
                        help="activation dtypes, comma-separated (each with the weight dtypes it is "
                             "meant for)")
    parser.add_argument("--all-combinations", action="store_true",
                        help="also bf16 activations with quantized weights and int8 activations with bf16 "
                             "weights")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of each engine (unless given: every core this process may run on)")
    parser.add_argument("--samples", type=int, default=3, help="timed samples per engine and row")
    parser.add_argument("--decode-tokens", type=int, default=128, help="tokens decoded per batch-1 sample")
    parser.add_argument("--batched-steps", type=int, default=32, help="decode steps per batched sample")
    parser.add_argument("--contexts", default="", type=lambda s: [int(c) for c in s.split(",") if c],
                        help="tokens of context for more batch-1 rows (decode_b1_ctx<N>), comma-separated")
    parser.add_argument("--batches", default="8,32", type=lambda s: [int(b) for b in s.split(",")],
                        help="batch sizes besides 1, comma-separated")
    parser.add_argument("--numaserve-threading", default="auto", choices=["auto", *NUMASERVE_THREADING],
                        help="numaserve's threading layer; auto: the faster in a short trial")
    parser.add_argument("--no-llamacpp", action="store_true", help="numaserve only")
    parser.add_argument("--no-torch-first", action="store_true", help='skip the "torch imported first" pair')
    parser.add_argument("--out", default=str(RESULTS / "decode.json"),
                        help="JSON to write (and the PNG beside it)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if any(m in sys.modules for m in ENGINE_MODULES):  # e.g. under `numaserve bench`: restart without them
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.bench_decode", *argv],
                  os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    args = build_parser().parse_args(argv)
    os.environ["NUMBA_THREADING_LAYER"] = "workqueue"  # this process's probes; the engines get CLEAN_ENV
    from benchmarks.machine import MachineProbe

    ckpt = random_checkpoint(args.model)
    probe = MachineProbe()
    machine = {"read_bytes_per_s": probe.read_bandwidth(repeats=5),
               "matmul_flop_per_s": probe.matmul_flops(repeats=5)}
    kinds = sorted({PEAK_KIND[a] for a in args.activation_dtypes if probe.has_peak(PEAK_KIND[a])})
    machine |= {f"peak_{k}_ops_per_s": probe.dot_peak(k) for k in kinds}
    # at the start (bandwidth and matmul: best of 5); each row keeps the median of its own probes
    print(json.dumps(machine), flush=True)
    loads = workloads(args, np.random.default_rng(0))
    dtypes = args.dtypes.split(",")
    meant = [a for a in args.activation_dtypes if args.all_combinations or dtypes[0] in MEANT_FOR[a]]
    threading, trial = pick_threading(ckpt, dtypes[0], meant[0], args, loads)
    meta = {"command": "python -m benchmarks.bench_decode " + " ".join(argv),
            "revision": revision(Path(__file__).resolve().parent.parent),
            "model": args.model, "threads": args.threads, "samples": args.samples, "cpu": cpu_name(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "decode_tokens": args.decode_tokens,
            "contexts": [DECODE_PROMPT_LEN, *args.contexts],
            "batched_steps": args.batched_steps, "processes": "one per engine (and per numaserve activation "
            "dtype), alternating sample by sample; probes in the parent (numba workqueue layer)",
            "numaserve_settings": {"threading": threading, "env": NUMASERVE_THREADING[threading],
                                   "trial": trial, "kv_dtype": "bfloat16", "max_num_batched_tokens": 512},
            "llamacpp_settings": None if args.no_llamacpp else {
                "env": "the parent's without OMP_*/GOMP_*/KMP_*/NUMBA_THREADING*",
                "n_threads": args.threads, "n_threads_batch": args.threads, "mmap": False,
                "logging": "silenced", "n_batch": 512, "kv_unified": True, "other": "llama.cpp defaults",
                "build": llama_cpp_build()}}
    rows = []
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    for i, dtype in enumerate(dtypes):
        rows += bench_dtype(ckpt, dtype, args, loads, probe, threading, first=i == 0)
        # after each dtype
        out.write_text(json.dumps({"meta": meta, "machine": machine, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
