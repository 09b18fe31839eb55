"""The prefix cache's disk tier: a long shared prefix after a restart, and what a disk read costs the streams
decoding beside it.

TinyLlama's shape (benchmarks/checkpoints.py, random weights; its config's positions raised to 8,192 so a
4k prefix fits: the weights are the same files) in q8_0, KV in the default dtype, every core.

1. Time to first token after a restart. Each sample draws its own prefix (PREFIX tokens, unique to the run and
   the sample) and three suffixes, and starts three fresh processes in turn, each over the same
   prefix_cache_dir (the benchmark's own, emptied first) and timing one request's first token after its engine
   loaded and ran one warm-up token: "cold" (prefix + suffix A: nothing on disk, the whole prompt is
   prefilled, its blocks written), "disk" (a restart: prefix + suffix B, the prefix read back from the disk
   tier, its files in the page cache as a restarted worker finds them), and, where this process may write
   /proc/sys/vm/drop_caches, "disk, cold page cache" (prefix + suffix C after the page cache was dropped: the
   files read from the device). Ratios to cold per sample, medians over samples.
2. Decode beside a disk read. One process keeps STREAMS greedy streams decoding (each restarted with a fresh
   prompt when it reaches its max tokens), and every few seconds submits a request whose PREFIX-token prefix
   is on disk but not in the pool (a pool that holds the streams and one prefix, cycling over three prefixes
   written beforehand). For every read: the mean step time of the pure decode steps that overlap the read
   (from the reader taking it up to its last block), against those of the READ_GAP_S seconds before it;
   the ratio of rates (before / during) per read, median over reads.

    python -m benchmarks.bench_prefix_disk [--samples 5] [--reads 15] [--prefix 4096] [--streams 8]

Writes benchmarks/results/prefix_disk.json and prefix_disk.png.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
SUFFIX_LEN = 24
STREAM_PROMPT, STREAM_TOKENS = 64, 256
READ_GAP_S = 2.0
VOCAB = 32000
DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def engine_fields(cache: str, prefix_dir: str, **more) -> dict:
    return {"weight_dtype": "q8_0", "packed_cache_dir": cache, "prefix_cache_dir": prefix_dir} | more


def tokens(seed: int, n: int) -> list[int]:
    import numpy as np
    return np.random.default_rng(seed).integers(3, VOCAB, n).tolist()


# ---- the sample processes ----------------------------------------------------------------------------------

def ttft_sample(model: str, fields: str, prefix_seed: int, suffix_seed: int, prefix_len: int) -> dict:
    import numaserve as ns

    with ns.LLM(model, **json.loads(fields)) as llm:
        llm.generate([tokens(1, 8)], ns.SamplingParams(max_tokens=1))  # warm-up: the kernels' first calls
        before = llm.stats()
        prompt = tokens(prefix_seed, prefix_len) + tokens(suffix_seed, SUFFIX_LEN)
        started = time.perf_counter()
        llm.generate([prompt], ns.SamplingParams(max_tokens=1, temperature=0))
        ttft = time.perf_counter() - started
        after = llm.stats()
    return {"ttft_s": ttft, "prefill_tokens": after["num_prefill_tokens"] - before["num_prefill_tokens"],
            "disk_hit_blocks": after["disk_hit_blocks"], "disk_read_bytes": after["disk_read_bytes"],
            "disk_written_blocks": after["disk_written_blocks"]}


def write_prefixes(model: str, fields: str, seeds: list[int], prefix_len: int) -> dict:
    import numaserve as ns

    with ns.LLM(model, **json.loads(fields)) as llm:
        for seed in seeds:
            prompt = tokens(seed, prefix_len) + tokens(seed + 1, SUFFIX_LEN)
            llm.generate([prompt], ns.SamplingParams(max_tokens=1))
        return {"written_blocks": llm.stats()["disk_written_blocks"]}


def decode_sample(model: str, fields: str, seeds: list[int], prefix_len: int, num_reads: int,
                  num_streams: int, run_seed: int) -> dict:
    import numaserve as ns
    from scheduling.engine import Engine

    engine = Engine(model, ns.EngineConfig(**json.loads(fields)))  # stepped here: no loop thread of its own
    stream_params = ns.SamplingParams(max_tokens=STREAM_TOKENS, temperature=0, ignore_eos=True)
    counter = iter(range(10 ** 9))
    streams: set[str] = set()
    steps, reads = [], []

    def add_stream() -> None:
        rid = f"stream-{next(counter)}"
        engine.add_request(rid, tokens(run_seed * 1000 + len(steps) + len(streams) + next(counter),
                                       STREAM_PROMPT), stream_params)
        streams.add(rid)

    def step() -> None:
        t0 = time.perf_counter()
        out = engine.step()
        steps.append((t0, time.perf_counter(), out.stats.num_prefill_tokens, out.stats.num_decode_tokens))
        for o in out.outputs:
            if o.finished and o.request_id in streams:
                streams.discard(o.request_id)
                add_stream()

    for _ in range(num_streams):
        add_stream()
    warm_until = time.perf_counter() + 5.0
    while time.perf_counter() < warm_until:
        step()
    for r in range(num_reads):
        gap_until = time.perf_counter() + READ_GAP_S
        while time.perf_counter() < gap_until:
            step()
        rid = f"read-{r}"
        seed = seeds[r % len(seeds)]
        engine.add_request(rid, tokens(seed, prefix_len) + tokens(run_seed + r, SUFFIX_LEN),
                           ns.SamplingParams(max_tokens=1))
        job = None
        while rid in engine.scheduler.requests:
            step()
            job = job or engine.scheduler.kv.loading.get(rid)
        if job is None:
            raise RuntimeError(f"read {r}: its prefix was not read from disk (in the pool already?)")
        reads.append({"started": job.started, "ended": job.ended, "blocks": job.num_loaded,
                      "of_blocks": len(job.keys)})
    stats = engine.stats()
    engine.close()
    return {"steps": steps, "reads": reads, "disk_hit_blocks": stats["disk_hit_blocks"],
            "block_bytes": engine.disk.block_bytes, "num_blocks": stats["num_blocks"]}


# ---- the benchmark -----------------------------------------------------------------------------------------

def run_sample(argv: list[str]) -> dict:
    from benchmarks.bench_decode import CLEAN_ENV
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_prefix_disk", "--sample", *argv], cwd=ROOT,
                         env=CLEAN_ENV, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def long_context(ckpt: Path, positions: int) -> Path:
    """The checkpoint's files under another config allowing `positions` (the weights linked, not copied)."""
    directory = ckpt.parent / f"{ckpt.name}-{positions // 1024}k"
    directory.mkdir(exist_ok=True)
    for f in ckpt.iterdir():
        if f.name != "config.json" and not (directory / f.name).exists():
            (directory / f.name).symlink_to(f)
    config = json.loads((ckpt / "config.json").read_text()) | {"max_position_embeddings": positions}
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


def drop_page_cache() -> bool:
    try:
        os.sync()
        DROP_CACHES.write_text("3\n")
    except OSError:
        return False
    return True


def step_ratios(decode: dict) -> list[dict]:
    """Per read: the mean pure-decode step time before it (READ_GAP_S) and during it; the rate ratio
    (during / before)."""
    pure = [(a, b) for a, b, prefill, dec in decode["steps"] if prefill == 0 and dec > 0]
    out = []
    for read in decode["reads"]:
        s, e = read["started"], read["ended"]
        during = [b - a for a, b in pure if b > s and a < e]
        before = [b - a for a, b in pure if s - READ_GAP_S <= a and b <= s]
        row = {"read_s": e - s, "blocks": read["blocks"], "of_blocks": read["of_blocks"],
               "steps_during": len(during), "steps_before": len(before)}
        if during and before:
            row |= {"step_s_before": statistics.mean(before), "step_s_during": statistics.mean(during),
                    "rate_ratio": statistics.mean(before) / statistics.mean(during)}
        out.append(row)  # (a read without pure decode steps on both sides has no ratio: listed, not counted)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4.2))
    med = results["ttft_medians_s"]
    names = list(med)
    ax1.bar(range(len(names)), [med[n] for n in names], color=["C3", "C0", "C2"][:len(names)])
    for i, n in enumerate(names):
        note = f"{med[n]:.2f} s" + ("" if n == "cold" else f"\n{results['ttft_ratios'][n]:.1%} of cold")
        ax1.annotate(note, (i, med[n]), ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(names)), names, fontsize=8)
    ax1.set_ylabel("time to first token, s (median)")
    ax1.set_ylim(0, 1.25 * max(med.values()))
    ax1.set_title(f"{results['meta']['prefix']}-token prefix after a restart", fontsize=9)
    ratios = [r["rate_ratio"] for r in results["decode_beside_reads"] if "rate_ratio" in r]
    ax2.plot(range(1, len(ratios) + 1), ratios, "o", color="C0")
    ax2.axhline(results["decode_rate_ratio_median"], color="C0", lw=1,
                label=f"median {results['decode_rate_ratio_median']:.3f}")
    ax2.axhline(0.95, color="C3", ls="--", lw=1, label="goal 0.95")
    ax2.set_xlabel("read")
    ax2.set_ylabel("decode rate during a read / before it")
    ax2.set_ylim(min(0.8, min(ratios) - 0.02), max(1.1, max(ratios) + 0.02))
    ax2.legend(fontsize=8)
    ax2.set_title(f"{results['meta']['streams']} streams decoding beside {results['meta']['prefix']}-token "
                  "reads", fontsize=9)
    meta = results["meta"]
    fig.suptitle(f"{meta['checkpoint']} q8_0, KV {meta['kv_dtype']}, {meta['cpu']}, {meta['threads']} "
                 "threads",
                 fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=5, help="restart samples (three processes each)")
    parser.add_argument("--reads", type=int, default=15, help="disk reads beside the decoding streams")
    parser.add_argument("--prefix", type=int, default=4096, help="tokens of the shared prefix")
    parser.add_argument("--streams", type=int, default=8, help="streams decoding beside the reads")
    parser.add_argument("--shape", default="tinyllama-1.1b", help="benchmarks/checkpoints.py SHAPES name")
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix_disk.json")
    parser.add_argument("--decode-only", action="store_true",
                        help="the decode part alone (a trial: its JSON has no restart rows)")
    parser.add_argument("--sample", nargs="+", help=argparse.SUPPRESS)  # inside a sample process
    args = parser.parse_args()
    if args.sample:
        kind, model, fields, *rest = args.sample
        if kind == "ttft":
            result = ttft_sample(model, fields, int(rest[0]), int(rest[1]), int(rest[2]))
        elif kind == "write":
            result = write_prefixes(model, fields, json.loads(rest[0]), int(rest[1]))
        else:
            result = decode_sample(model, fields, json.loads(rest[0]), *map(int, rest[1:]))
        print(json.dumps(result), flush=True)
        return
    from benchmarks.bench_revisions import revision
    from benchmarks.checkpoints import CACHE, random_checkpoint
    from benchmarks.machine import cpu_name
    from memory.kv_cache import kv_bytes_per_token

    ckpt = random_checkpoint(args.shape)
    model = long_context(ckpt, 8192)
    packed, disk = str(CACHE / "packed-bench"), CACHE / "prefix-disk-bench"
    shutil.rmtree(disk, ignore_errors=True)
    run_seed = int(time.time()) % 100000 * 1000  # prompts unique to this run
    fields = json.dumps(engine_fields(packed, str(disk)))

    def ttft(prefix_seed: int, suffix_seed: int) -> dict:
        return run_sample(["ttft", str(model), fields, str(prefix_seed), str(suffix_seed), str(args.prefix)])

    ttft(run_seed, run_seed + 1)  # untimed: the packed entry written, numba's kernels cached
    can_drop = drop_page_cache()
    samples = {"cold": [], "disk": []} | ({"disk, cold page cache": []} if can_drop else {})
    for s in range(0 if args.decode_only else args.samples):
        seed = run_seed + 10 * (s + 1)
        samples["cold"].append(ttft(seed, seed + 1))
        samples["disk"].append(ttft(seed, seed + 2))
        if can_drop:
            drop_page_cache()
            samples["disk, cold page cache"].append(ttft(seed, seed + 3))
    for name, got in samples.items():  # cold: the whole prompt prefilled; a restart: the suffix alone
        expect = args.prefix + SUFFIX_LEN if name == "cold" else SUFFIX_LEN + args.prefix % 16
        if any(g["prefill_tokens"] != expect for g in got):
            raise RuntimeError(f"{name}: prefilled {[g['prefill_tokens'] for g in got]} tokens, expected "
                               f"{expect}")
    ttft_medians = {name: statistics.median(g["ttft_s"] for g in got) for name, got in samples.items() if got}
    ttft_ratios = {name: statistics.median(g["ttft_s"] / c["ttft_s"] for g, c in zip(got, samples["cold"]))
                   for name, got in samples.items() if name != "cold" and got}

    # decode beside reads: three prefixes on disk; a pool for the streams and about one prefix
    seeds = [run_seed + 500 + 10 * k for k in range(3)]
    config = json.loads((model / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    per_token = kv_bytes_per_token(config["num_hidden_layers"], config["num_key_value_heads"], head_dim,
                                   "bfloat16")
    pool_tokens = args.streams * (STREAM_PROMPT + STREAM_TOKENS + 16) + args.prefix + SUFFIX_LEN + 512
    run_sample(["write", str(model), fields, json.dumps(seeds), str(args.prefix)])
    decode_fields = json.dumps(engine_fields(packed, str(disk), kv_cache_bytes=pool_tokens * per_token,
                                             max_num_seqs=args.streams + 1))
    decode = run_sample(["decode", str(model), decode_fields, json.dumps(seeds), str(args.prefix),
                         str(args.reads), str(args.streams), str(run_seed)])
    beside = step_ratios(decode)
    ratio = statistics.median(r["rate_ratio"] for r in beside if "rate_ratio" in r)
    meta = {"command": "python -m benchmarks.bench_prefix_disk " + " ".join(sys.argv[1:]),
            "revision": revision(ROOT), "date": time.strftime("%Y-%m-%d %H:%M"), "cpu": cpu_name(),
            "checkpoint": model.name, "kv_dtype": "bfloat16 (auto)", "prefix": args.prefix,
            "suffix": SUFFIX_LEN, "samples": args.samples, "reads": args.reads, "streams": args.streams,
            "threads": len(os.sched_getaffinity(0)), "kv_bytes_per_token": per_token,
            "page_cache_dropped": can_drop,
            "prefix_bytes_on_disk": statistics.median([g["disk_read_bytes"] for g in samples["disk"]] or [0])}
    results = {"meta": meta, "ttft_medians_s": ttft_medians, "ttft_ratios": ttft_ratios,
               "ttft_within_15pct": all(r <= 0.15 for r in ttft_ratios.values()),
               "decode_rate_ratio_median": ratio, "decode_within_5pct": ratio >= 0.95,
               "decode_beside_reads": beside, "samples": samples,
               "read_seconds_median": statistics.median(r["read_s"] for r in beside),
               "reads_without_ratio": sum("rate_ratio" not in r for r in beside)}
    print(json.dumps({k: v for k, v in results.items() if k not in ("samples", "decode_beside_reads")},
                     indent=1))
    if args.decode_only:  # a trial, not a result
        print(json.dumps(beside, indent=1))
        return
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
