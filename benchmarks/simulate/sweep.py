"""python -m benchmarks.simulate.sweep: workers 1, 2, 4 ... 256 per trace and policy variant, each worker
offered LOAD x one worker's capacity (measured first, per trace, by a long saturated one-worker run of the
default deployment, so the load follows the step cost model in use); throughput against 0.9 x N x one
worker's (same trace, variant and load), and where each variant falls below it. Writes
benchmarks/results/simulate_sweep.json and .png.

    python -m benchmarks.simulate.sweep [--max-workers 256] [--duration-s 12] [--load 0.8] [--jobs 2]
"""

import argparse
import json
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

from numaserve.simulate.config import SimConfig
from numaserve.simulate.simulator import simulate
from numaserve.simulate.traces import TRACES

RESULTS = Path(__file__).resolve().parents[1] / "results"
VARIANTS = {  # name -> SimConfig fields changed from the default deployment
    "default": {},  # placement routing, admission bound, session stickiness, prefix affinity, no speculation
    "relay": {"routing": "relay"},  # every chunk through the router, as today
    "no_admission": {"admission": False},
    "no_stickiness": {"stickiness": False},
    "no_prefix_affinity": {"prefix_affinity": False},
    "speculation_auto": {"speculation": "auto"},
}
# offered load per worker, as a fraction of one worker's capacity: near it, where the policies matter (a
# worker given more than its share queues), and below it, so the window reaches a steady state quickly
# (saturated workers' queues grow through any window)
LOAD = 0.8
CAPACITY_DURATION_S, CAPACITY_WARMUP_S = 60.0, 20.0
# every N runs as long (the window's warm-up transient biases a shorter run's throughput down): long enough
# for a 64-token request's life to be a small part of the window
WARMUP_S = 4.0
NUM_REFERENCE_SEEDS = 32  # one worker's throughput, the reference of every N: the mean over this many seeds
WORKERS_PER_MACHINE = 2  # one worker per socket of 2-socket machines: one caller (HTTP actor) per machine
FIGURES = ("throughput_tok_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "imbalance",
           "session_hit_rate", "prefix_hit_rate", "completed", "rejected", "arrived", "preemptions",
           "router_utilization", "caller_utilization_max", "routed")
EFFICIENCY_TARGET = 0.9


def run_one(job: tuple[str, str, int, float, float, int, bool]) -> dict:
    """reference: a one-worker run of another seed, for the reference's mean only."""
    trace, variant, workers, rate_per_worker, duration_s, seed, reference = job
    cfg = SimConfig(workers=workers, machines=max(1, workers // WORKERS_PER_MACHINE),
                    rate=rate_per_worker * workers, duration_s=duration_s, warmup_s=WARMUP_S, trace=trace,
                    seed=seed, **VARIANTS[variant])
    result = simulate(cfg)
    return {"trace": trace, "variant": variant, "workers": workers, "rate_per_worker": rate_per_worker,
            "duration_s": duration_s, "seed": seed, "reference": reference} | {k: result[k] for k in FIGURES}


def capacity(trace: str, seed: int) -> float:
    """One worker's requests/s under the default deployment, saturated: the first offered rate (1, 4, 16 ...
    requests/s) it cannot keep up with, its throughput in tokens / max_tokens."""
    rate = 1.0
    while True:
        cfg = SimConfig(workers=1, rate=rate, duration_s=CAPACITY_DURATION_S, warmup_s=CAPACITY_WARMUP_S,
                        trace=trace, seed=seed)
        served = simulate(cfg)["throughput_tok_s"] / cfg.max_tokens
        if served < 0.8 * rate:
            return served
        rate *= 4


def summarize(rows: list[dict]) -> dict:
    """Each row's efficiency (throughput / (N x one worker's)); per trace and variant, the N from which every
    larger N stays below EFFICIENCY_TARGET (None: none; a single N below it among few workers is the draw of
    a handful of arrivals, not a breakdown). The reference rows (one worker, other seeds) leave rows."""
    refs: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        if r["workers"] == 1:
            refs.setdefault((r["trace"], r["variant"]), []).append(r["throughput_tok_s"])
    one = {key: sum(v) / len(v) for key, v in refs.items()}
    rows[:] = [r for r in rows if not r.pop("reference")]
    breakdown: dict[str, dict[str, int | None]] = {}
    for r in sorted(rows, key=lambda r: r["workers"]):
        base = one.get((r["trace"], r["variant"]))
        r["efficiency"] = r["throughput_tok_s"] / (r["workers"] * base) if base else None
        at = breakdown.setdefault(r["trace"], {}).setdefault(r["variant"], None)
        below = r["efficiency"] is not None and r["efficiency"] < EFFICIENCY_TARGET
        if r["workers"] > 1:
            breakdown[r["trace"]][r["variant"]] = (at or r["workers"]) if below else None
    return breakdown


def plot(rows: list[dict], traces: list[str], load: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(traces), figsize=(4.5 * len(traces), 7), squeeze=False)
    for col, trace in enumerate(traces):
        for variant in VARIANTS:
            series = sorted((r for r in rows if r["trace"] == trace and r["variant"] == variant),
                            key=lambda r: r["workers"])
            if not series:
                continue
            xs = [r["workers"] for r in series]
            axes[0, col].plot(xs, [r["efficiency"] for r in series], "o-", ms=3, label=variant)
            ttft = [r["ttft_p99_s"] or float("nan") for r in series]
            axes[1, col].plot(xs, ttft, "o-", ms=3, label=variant)
        axes[0, col].axhline(EFFICIENCY_TARGET, color="k", ls="--", lw=0.8)
        axes[0, col].set_title(trace)
        axes[0, col].set_ylabel("throughput / (N x one worker's)")
        axes[1, col].set_ylabel("TTFT p99 (s)")
        axes[1, col].set_yscale("log")
        for ax in axes[:, col]:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("workers")
            ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"simulated deployment: each worker offered {load:g} x one worker's capacity")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-workers", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=12.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load", type=float, default=LOAD, help="offered load per worker / its capacity")
    p.add_argument("--traces", default=",".join(TRACES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--jobs", type=int, default=os.cpu_count())
    p.add_argument("--out", type=Path, default=RESULTS / "simulate_sweep", help="writes OUT.json and OUT.png")
    a = p.parse_args()
    traces, variants = a.traces.split(","), a.variants.split(",")
    sizes = [1 << i for i in range(a.max_workers.bit_length()) if 1 << i <= a.max_workers]
    start = time.perf_counter()
    with Pool(a.jobs) as pool:
        capacities = dict(zip(traces, pool.starmap(capacity, [(t, a.seed) for t in traces])))
    rates = {t: a.load * c for t, c in capacities.items()}
    jobs = [(t, v, n, rates[t], a.duration_s, a.seed, False)
            for t in traces for v in variants for n in sizes]
    jobs += [(t, v, 1, rates[t], a.duration_s, a.seed + k, True)
             for t in traces for v in variants for k in range(1, NUM_REFERENCE_SEEDS)]
    jobs.sort(key=lambda job: -job[2])  # the largest first
    with Pool(a.jobs) as pool:
        rows = list(pool.imap_unordered(run_one, jobs))
    wall_s = time.perf_counter() - start
    rows.sort(key=lambda r: (r["trace"], r["variant"], r["workers"]))
    breakdown = summarize(rows)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"load": a.load, "capacity_per_worker": capacities, "rate_per_worker": rates, "warmup_s": WARMUP_S,
            "num_reference_seeds": NUM_REFERENCE_SEEDS, "workers_per_machine": WORKERS_PER_MACHINE,
            "duration_s": a.duration_s, "seed": a.seed, "step_cost": SimConfig().step_cost.source,
            "wall_s": wall_s, "jobs": a.jobs}
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "breakdown": breakdown, "rows": rows},
                                                     indent=1) + "\n")
    plot(rows, traces, a.load, a.out.with_suffix(".png"))
    print(json.dumps(breakdown, indent=1))
    print(f"{len(jobs)} runs in {wall_s:.0f} s on {a.jobs} processes", file=sys.stderr)


if __name__ == "__main__":
    main()
