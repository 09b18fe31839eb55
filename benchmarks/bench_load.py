"""Load time: numaserve's first start of a model (cold: an empty packed cache, so it hashes the file, loads,
repacks and writes an entry) and its second (warm: it reads the entry back) against llama.cpp's load of the
same file (by default, and without mmap).

A TinyLlama-shaped random checkpoint (benchmarks/checkpoints.py: 1.1B parameters), exported once to a q8_0
GGUF by numaserve (models.gguf.writer.convert_to_gguf, in a short-lived process): 1.17 GB (--dtype: another
format of the same weights, bfloat16 2.2 GB). Every sample is a fresh process that times its constructor
alone (its imports timed apart): numaserve.LLM(gguf, packed_cache_dir=a benchmark's own directory) with its
defaults otherwise, and llama_cpp.Llama(gguf, n_ctx=256, verbose=False) with llama.cpp's defaults
otherwise (mmap on: its load maps the file and reads little of it), and once more with use_mmap=False (it
then reads the file into memory, as numaserve does and as benchmarks/llamacpp_runner.py runs it). So each
process then also times its first token (one token's logits), which reads every weight: llama.cpp's deferred
page faults land there. llama.cpp gets the same threads for that token as numaserve uses
(n_threads, n_threads_batch; they do not change its load). The four runs alternate, the order flipping every
sample (benchmarks/bench_decode.alternate); a cold run empties the cache directory first; the files are read
through once before every sample, so each run starts with them in the page cache. Medians from one run.

Resident memory is also broken down by what holds it after the first token (resident_parts: the weights'
file's mapping, shared libraries, anonymous memory, other files). A warm start runs twice: reading the entry
into memory of its own (map_packed_weights=False) and mapping it (True). Each numaserve process then decodes
DECODE_TOKENS tokens at batch 1 (greedy, EOS ignored, a prompt of its own; after a few untimed tokens, so
every decode kernel is loaded): what the weights' pages (a buffer's huge pages, or the page cache's, huge only
where the kernel's page cache keeps large folios) cost a stream.

    python -m benchmarks.bench_load [--shape tinyllama|small] [--dtype q8_0|q4_k_m|bfloat16] [--samples 7]

Writes benchmarks/results/load.json and load.png (load-<dtype>.json and .png for another --dtype).
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
CHECKPOINTS = {"tinyllama": "tinyllama-1.1b", "small": "llama-56m"}  # --shape -> benchmarks/checkpoints.py
N_CTX = 256
RUNS = ("numaserve cold", "numaserve warm read", "numaserve warm mapped", "llama.cpp", "llama.cpp no mmap")
WARM = {"numaserve warm read": False, "numaserve warm mapped": True}  # run -> map_packed_weights
DECODE_TOKENS = 48
PROMPT_TOKENS = 16


# ---- the sample processes ----------------------------------------------------------------------------------

def numaserve_sample(gguf: str, cache_dir: str, how: str) -> dict:
    """how: "default" (map_packed_weights as EngineConfig has it), "read" or "mapped" (False, True)."""
    started = time.perf_counter()
    import numaserve as ns

    imported = time.perf_counter()
    llm = ns.LLM(gguf, packed_cache_dir=cache_dir, **({} if how == "default" else
                                                      {"map_packed_weights": how == "mapped"}))
    loaded = time.perf_counter()
    rss_loaded = resident_bytes()
    llm.generate([1], ns.SamplingParams(max_tokens=1, temperature=0))
    first_token = time.perf_counter()
    decode = decode_tok_s(llm, ns)
    stats = llm.engine.load_stats
    return {"import_s": imported - started, "load_s": loaded - imported,
            "first_token_s": first_token - loaded, "decode_tok_s": decode,
            "outcome": stats.outcome, "reason": stats.reason,
            "hash_s": stats.hash_seconds, "entry_bytes": stats.entry_bytes,
            "threads": llm.engine.decisions.recent("threading")[0]["choice"],
            "weight_bytes": llm.engine.model.weight_bytes, "rss_loaded_bytes": rss_loaded,
            "rss_first_token_bytes": resident_bytes(), "peak_rss_bytes": peak_resident_bytes(),
            **resident_parts()}


def decode_tok_s(llm, ns) -> float:
    """Batch-1 greedy decode, tokens a second: DECODE_TOKENS tokens after a prompt of PROMPT_TOKENS tokens
    drawn for this process (the prompt's prefill is in the time: about one decode step's worth here)."""
    rng = random.Random(os.urandom(8))
    vocab = llm.engine.spec.vocab_size

    def prompt() -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(PROMPT_TOKENS)]

    llm.generate(prompt(), ns.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # untimed
    params = ns.SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    started = time.perf_counter()
    [out] = llm.generate(prompt(), params)
    seconds = time.perf_counter() - started
    if len(out.token_ids) != DECODE_TOKENS:
        raise RuntimeError(f"decoded {len(out.token_ids)} tokens, asked {DECODE_TOKENS}")
    return DECODE_TOKENS / seconds


def llamacpp_sample(gguf: str, threads: int, use_mmap: bool) -> dict:
    started = time.perf_counter()
    import llama_cpp

    imported = time.perf_counter()
    llm = llama_cpp.Llama(gguf, n_ctx=N_CTX, n_threads=threads, n_threads_batch=threads, use_mmap=use_mmap,
                          verbose=False)
    loaded = time.perf_counter()
    rss_loaded = resident_bytes()
    llm.eval([llm.token_bos()])
    return {"import_s": imported - started, "load_s": loaded - imported,
            "first_token_s": time.perf_counter() - loaded, "rss_loaded_bytes": rss_loaded,
            "rss_first_token_bytes": resident_bytes(), "peak_rss_bytes": peak_resident_bytes(),
            **resident_parts()}


RESIDENT_PARTS = ("weights_file", "shared_libraries", "anonymous", "other_files")


def resident_parts() -> dict[str, int]:
    """This process's resident bytes now by what holds them (/proc/self/smaps): mappings of the weights'
    file (the packed entry or the GGUF), of shared libraries (their code: libllvmlite.so is numba's LLVM),
    anonymous memory (the heap, numpy's arrays, the JIT's code) and other files."""
    from memory.smaps import mappings  # here: a sample's import_s times numaserve's imports alone

    parts = dict.fromkeys(RESIDENT_PARTS, 0)
    for m in mappings():
        part = ("weights_file" if m.path.endswith((".packed", ".gguf")) else
                "shared_libraries" if ".so" in Path(m.path).name else
                "other_files" if m.path.startswith("/") else "anonymous")
        parts[part] += m.kb.get("Rss", 0) * 1024
    return {f"rss_{k}_bytes": v for k, v in parts.items()}


def resident_bytes() -> int:
    """This process's resident memory now: its own pages and the file pages it maps (a mapped weight counts
    once it was touched)."""
    import psutil
    return psutil.Process().memory_info().rss


def peak_resident_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---- the benchmark -----------------------------------------------------------------------------------------

def run_sample(argv: list[str], env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_load", "--sample", *argv], cwd=ROOT,
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def read_through(paths: list[Path]) -> None:
    """Every byte once, so the page cache holds the files (the VM may have reclaimed them meanwhile)."""
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def exported_gguf(ckpt: Path, dtype: str) -> Path:
    from benchmarks.checkpoints import CACHE

    gguf = CACHE / f"{ckpt.name}-{dtype}.gguf"  # the name bench_moe and bench_decode give their exports
    if not gguf.exists():
        code = ("import sys; from models.gguf.writer import convert_to_gguf; "
                "convert_to_gguf(sys.argv[1], sys.argv[2], sys.argv[3])")
        subprocess.run([sys.executable, "-c", code, str(ckpt), str(gguf), dtype], cwd=ROOT, check=True)
    return gguf


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = results["medians"]
    fig, ax = plt.subplots(figsize=(8.4, 4.4))
    x = range(len(RUNS))
    load = [med[r]["load_s"] for r in RUNS]
    first = [med[r]["first_token_s"] for r in RUNS]
    colors = ["C3", "C0", "C4", "C1", "C2"]
    ax.bar(x, load, 0.6, color=colors, label="load (constructor)")
    ax.bar(x, first, 0.6, bottom=load, color=colors, alpha=0.35, hatch="//",
           label="first token (reads every weight)")
    for i, r in enumerate(RUNS):
        note = f"{load[i]:.2f} s"
        if r.startswith("numaserve"):
            note += f"\n{results['ratios'][r + ' / llama.cpp']:.1f}x llama.cpp's load"
        if "decode_tok_s" in med[r]:
            note += f"\ndecode {med[r]['decode_tok_s']:.1f} tok/s"
        ax.annotate(note, (i, load[i] + first[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [r.replace("numaserve ", "numaserve\n") for r in RUNS], fontsize=8)
    ax.set_ylabel("seconds (median)")
    ax.set_ylim(0, 1.25 * max(a + b for a, b in zip(load, first)))
    ax.legend(fontsize=8, loc="upper right")
    meta = results["meta"]
    fig.suptitle(f"{meta['checkpoint']} {meta['dtype']} GGUF ({meta['gguf_bytes'] / 1e9:.2f} GB), "
                 f"{meta['cpu']}, {meta['samples']} samples", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tinyllama", choices=list(CHECKPOINTS),
                        help="tinyllama: TinyLlama-1.1B's shape; small: llama-56m (a smoke test)")
    parser.add_argument("--samples", type=int, default=7, help="timed samples per run")
    parser.add_argument("--dtype", default="q8_0", choices=["q8_0", "q4_k_m", "bfloat16"],
                        help="the GGUF's weights (q4_k_m: llama.cpp's mix, as llama-quantize writes it)")
    parser.add_argument("--out", type=Path, help="default benchmarks/results/load.json (q8_0), "
                                                 "load-<dtype>.json")
    parser.add_argument("--sample", nargs="+", help=argparse.SUPPRESS)  # inside a sample process
    args = parser.parse_args()
    if args.sample:
        engine, *rest = args.sample
        result = (numaserve_sample(*rest) if engine == "numaserve" else
                  llamacpp_sample(rest[0], int(rest[1]), rest[2] == "mmap"))
        print(json.dumps(result), flush=True)
        return
    from benchmarks.bench_decode import CLEAN_ENV, alternate
    from benchmarks.bench_revisions import revision
    from benchmarks.checkpoints import CACHE, checkpoint_config, random_checkpoint
    from benchmarks.machine import cpu_name

    ckpt = random_checkpoint(CHECKPOINTS[args.shape])
    gguf = exported_gguf(ckpt, args.dtype)
    out = args.out or RESULTS / ("load.json" if args.dtype == "q8_0" else f"load-{args.dtype}.json")
    cache_dir = CACHE / "packed-bench"  # the benchmark's own: emptied before every cold run
    threads = len(os.sched_getaffinity(0))

    def numaserve(cold: bool, how: str = "default"):
        def run() -> dict:
            if cold:
                shutil.rmtree(cache_dir, ignore_errors=True)
            read_through([gguf, *cache_dir.glob("*.packed")])
            return run_sample(["numaserve", str(gguf), str(cache_dir), how], CLEAN_ENV)
        return run

    def llamacpp(mmap: bool):
        def run() -> dict:
            read_through([gguf])
            return run_sample(["llamacpp", str(gguf), str(threads), "mmap" if mmap else "read"], CLEAN_ENV)
        return run

    runs = dict(zip(RUNS, (numaserve(True), numaserve(False, "read"), numaserve(False, "mapped"),
                           llamacpp(True), llamacpp(False))))
    numaserve(True)()  # untimed: numba's kernels compiled and cached, the entry written
    samples = alternate(args.samples, runs)
    expected = {"numaserve cold": "built"} | {name: "hit" for name in WARM}
    for name, outcome in expected.items():
        if any(s["outcome"] != outcome for s in samples[name]):
            raise RuntimeError(f"{name}: outcomes {[s['outcome'] for s in samples[name]]}, expected "
                               f"{outcome}")
    timed = ("import_s", "load_s", "first_token_s", "decode_tok_s", "rss_loaded_bytes",
             "rss_first_token_bytes", "peak_rss_bytes", *(f"rss_{k}_bytes" for k in RESIDENT_PARTS))
    medians = {name: {k: statistics.median(s[k] for s in got) for k in timed if k in got[0]}
               for name, got in samples.items()}
    weight_bytes = samples["numaserve warm read"][0]["weight_bytes"]
    cold = medians["numaserve cold"]
    memory = {"weight_bytes": weight_bytes,  # numaserve's resident memory over its weights' bytes
              "cold_peak (building the entry)": cold["peak_rss_bytes"] / weight_bytes}
    for name in WARM:
        memory[f"{name}: resident_after_first_token"] = medians[name]["rss_first_token_bytes"] / weight_bytes
        memory[f"{name}: peak"] = medians[name]["peak_rss_bytes"] / weight_bytes
    # after the first token, MB: what besides the weights (anonymous memory holds them when read)
    memory["resident parts (MB)"] = {name: {k: medians[name][f"rss_{k}_bytes"] / 1e6 for k in RESIDENT_PARTS}
                                     for name in RUNS}
    pairs = list(zip(samples["numaserve warm mapped"], samples["numaserve warm read"]))
    decode = {"mapped / read (medians)": (medians["numaserve warm mapped"]["decode_tok_s"]
                                          / medians["numaserve warm read"]["decode_tok_s"]),
              "mapped / read (median of the samples' pairs)": statistics.median(
                  m["decode_tok_s"] / r["decode_tok_s"] for m, r in pairs)}
    ratios, to_first = {}, {}  # numaserve's over llama.cpp's: load; load and first token
    for name in expected:
        for ref in ("llama.cpp", "llama.cpp no mmap"):
            mine, theirs = medians[name], medians[ref]
            ratios[f"{name} / {ref}"] = mine["load_s"] / theirs["load_s"]
            to_first[f"{name} / {ref}"] = ((mine["load_s"] + mine["first_token_s"])
                                           / (theirs["load_s"] + theirs["first_token_s"]))
    meta = {"command": "python -m benchmarks.bench_load " + " ".join(sys.argv[1:]),
            "revision": revision(ROOT), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
            "checkpoint": ckpt.name, "dtype": args.dtype,
            "config": checkpoint_config(ckpt.name), "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size,
            "entry_bytes": samples["numaserve warm read"][0]["entry_bytes"], "samples": args.samples,
            "kernel": os.uname().release, "decode": f"batch 1, {DECODE_TOKENS} tokens after a "
                                                    f"{PROMPT_TOKENS}-token prompt, greedy",
            "threads": threads, "n_ctx": N_CTX, "page_cache": "warm: files read through before every sample",
            "llamacpp_settings": "llama_cpp.Llama(gguf, n_ctx=256, n_threads=n_threads_batch=threads, "
                                 "verbose=False), defaults otherwise (mmap on); 'no mmap': use_mmap=False"}
    results = {"meta": meta, "medians": medians, "ratios": ratios, "load_and_first_token_ratios": to_first,
               "warm_within_2x_llamacpp": {name: to_first[f"{name} / llama.cpp"] <= 2.0 for name in WARM},
               "decode_ratios": decode, "memory_over_weights": memory, "samples": samples}
    print(json.dumps({k: v for k, v in results.items() if k not in ("samples", "meta")}, indent=1))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))
    plot(results, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
