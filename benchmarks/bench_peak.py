"""This CPU's limits for the kernels: the dot-product instructions' peak per core and for all cores
(register-resident loops, benchmarks/peak_kernels.py: int8 vpdpbusd, bf16 vdpbf16ps, float32 FMA, at 256
and 512 bits where the CPU has them; vpmaddwd, the int8 path without VNNI) beside the memory read probe.

Samples alternate loop by loop (one thread, then every thread, then the read probe), --samples rounds, the
order flipping every round: the VM's speed swings within seconds. Each row keeps its median and its best; a
kind's peak is its fastest instruction's median on every thread, the figure `numaserve bench` divides by.

    python -m benchmarks.bench_peak [--samples 7] [--threads N]

Writes benchmarks/results/peak.json and peak.png.
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
KINDS = ("int8", "bf16", "f32")


def measure(args) -> dict:
    import numba

    from benchmarks.machine import MachineProbe
    from benchmarks.peak_kernels import DotPeak, available, num_accs

    numba.set_num_threads(args.threads)
    probe = MachineProbe()
    loops = {ins.label: DotPeak(ins) for ins in available()}
    runs = {"read": probe.read_bandwidth}
    for label, loop in loops.items():
        runs[f"{label}|core"] = lambda loop=loop: loop.ops_per_s(all_threads=False)
        runs[f"{label}|all"] = lambda loop=loop: loop.ops_per_s(all_threads=True)
    samples = {name: [] for name in runs}
    for s in range(args.samples):
        for name in (list(runs) if s % 2 == 0 else list(runs)[::-1]):
            samples[name].append(runs[name]())
    rows = []
    for label, loop in loops.items():
        core, every = samples[f"{label}|core"], samples[f"{label}|all"]
        rows.append({"instruction": label, "kind": loop.ins.kind, "bits": loop.ins.bits,
                     "features": list(loop.ins.features), "macs_per_instruction": loop.ins.macs,
                     "chains": num_accs(), "iterations": loop.iterations,
                     "per_core_ops_s": statistics.median(core), "per_core_best_ops_s": max(core),
                     "all_cores_ops_s": statistics.median(every), "all_cores_best_ops_s": max(every),
                     "samples": {"core": core, "all": every}})
    peaks = {}
    for kind in KINDS:
        mine = [r for r in rows if r["kind"] == kind]
        if mine:
            best = max(mine, key=lambda r: r["all_cores_ops_s"])
            peaks[kind] = {"instruction": best["instruction"], "all_cores_ops_s": best["all_cores_ops_s"],
                           "per_core_ops_s": best["per_core_ops_s"]}
    return {"rows": rows, "peaks": peaks, "read_bytes_per_s": statistics.median(samples["read"]),
            "read_samples": samples["read"]}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = results["rows"]
    fig, ax = plt.subplots(figsize=(8, 3.8))
    at = np.arange(len(rows))
    ax.bar(at - 0.2, [r["per_core_ops_s"] / 1e9 for r in rows], 0.4, label="one core")
    ax.bar(at + 0.2, [r["all_cores_ops_s"] / 1e9 for r in rows], 0.4,
           label=f"{results['threads']} threads")
    ax.set_xticks(at, [r["instruction"].replace(" ", "\n") for r in rows], fontsize=7)
    ax.set_ylabel("G operations/s (multiply-add = 2)")
    ax.set_title(f"dot-product peak; read probe {results['read_bytes_per_s'] / 1e9:.1f} GB/s\n"
                 f"{results['machine']['cpu']}", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=7, help="rounds over every probe")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="threads of the every-thread loops (unless given: every core this process may "
                             "run on)")
    parser.add_argument("--out", type=Path, default=RESULTS / "peak.json")
    args = parser.parse_args(argv)
    os.environ.setdefault("NUMBA_THREADING_LAYER", "workqueue")  # as the other benchmarks' probes
    from benchmarks.machine import cpu_name

    words = sys.argv[1:] if argv is None else argv
    results = {"command": " ".join(["python -m benchmarks.bench_peak", *words]),
               "machine": {"cpu": cpu_name(), "platform": platform.platform()}, "threads": args.threads,
               "samples": args.samples, "date": time.strftime("%Y-%m-%d %H:%M")} | measure(args)
    for r in results["rows"]:
        print(f"{r['instruction']:>26}: {r['per_core_ops_s'] / 1e9:7.1f} G op/s a core, "
              f"{r['all_cores_ops_s'] / 1e9:7.1f} on {args.threads} threads", flush=True)
    print(f"read probe: {results['read_bytes_per_s'] / 1e9:.1f} GB/s")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
