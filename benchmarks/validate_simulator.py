"""The simulator against the real deployment it models: the same Poisson trace at a few rates, played once
through 2 workers pinned to one core each (as benchmarks/bench_serving.py deploys them: TinyLlama-shaped
random checkpoint, q8_0 weights, int8 activations, through ns.Client) and once through the simulator with
the same workers, engine, deployment settings, trace and the fitted step cost.

    python -m benchmarks.validate_simulator [--rates 0.3,0.6,0.9] [--duration-s 60] [--warmup-s 10]
    NUMASERVE_BENCH_SHORT=1 python -m benchmarks.validate_simulator    (a smoke run: llama-56m, 4 s a rate)

The step cost is fitted with the engine on all FIT_CORES cores; a pinned worker has one of them and shares
the memory with the other, so each simulated worker's model is the fit's scaled to compute x1/2 and
bandwidth x1/2 (worker_step_cost). The real side counts as the simulator does (Simulation._deliver): TTFT
from a request's arrival to its first chunk, each later chunk's gap shared by its tokens (ITL), throughput
the tokens delivered in [warmup, duration) over that window. Writes benchmarks/results/simulate_validation
.json and .png with each rate's figures and the simulator's relative error (simulated / real - 1). Run it
alone on the machine: the real side is wall time. Its relative errors are stated in the README.
"""

import argparse
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import ray

import numaserve as ns
from benchmarks.bench_serving import ENGINE as SERVING_ENGINE
from benchmarks.bench_serving import cluster_config
from benchmarks.checkpoints import random_checkpoint
from cluster_configs.engine_config import EngineConfig
from numaserve.simulate.config import SimConfig
from numaserve.simulate.simulator import simulate
from numaserve.simulate.step_cost import StepCostModel, default_step_cost
from numaserve.simulate.traces import Arrival, make_trace

RESULTS = Path(__file__).parent / "results"
SHORT = os.environ.get("NUMASERVE_BENCH_SHORT") == "1"
MODEL = "llama-56m" if SHORT else "tinyllama-1.1b"
ENGINE = SERVING_ENGINE | {"weight_dtype": "q8_0", "activation_dtype": "int8"}
MAX_MODEL_LEN = 2048  # the llama shapes' max_position_embeddings (benchmarks/checkpoints.py)
FIT_CORES = 2  # benchmarks/fit_step_cost.py's engine ran on this VM's 2 cores
FIGURES = ("throughput_tok_s", "ttft_p50_s", "itl_p50_s")


def worker_step_cost(base: StepCostModel, num_workers: int, num_cores: int) -> StepCostModel:
    """A worker pinned to num_cores / num_workers cores, all num_workers sharing the memory."""
    return base.scaled(compute=num_cores / num_workers / FIT_CORES, bandwidth=1.0 / num_workers,
                       source=f"{base.source}, per worker of {num_workers} on {num_cores} cores")


@dataclass
class Played:
    """One request as its caller saw it: seconds from the trace's start."""
    arrived_at: float
    deliveries: list[tuple[float, int]] = field(default_factory=list)  # (when, tokens) per chunk
    rejected: bool = False


def play(client, arrivals: list[Arrival], params: ns.SamplingParams) -> list[Played]:
    """Each arrival streamed by a thread of its own from its trace time on."""
    played = [Played(a.time) for a in arrivals]
    start = time.perf_counter()

    def one(a: Arrival, p: Played) -> None:
        time.sleep(max(0.0, start + a.time - time.perf_counter()))
        p.arrived_at = time.perf_counter() - start
        try:
            for chunk in client.stream(list(a.prompt_ids), params):
                p.deliveries.append((time.perf_counter() - start, len(chunk.token_ids)))
        except ns.Overloaded:
            p.rejected = True

    threads = [threading.Thread(target=one, args=(a, p), daemon=True) for a, p in zip(arrivals, played)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return played


def figures(played: list[Played], duration_s: float, warmup_s: float) -> dict:
    """The simulator's figures from what the callers received, counted as Simulation._deliver counts them."""
    ttft, itl, window_tokens = [], [], 0
    for p in played:
        deliveries = [(t, n) for t, n in p.deliveries if n]
        for i, (t, n) in enumerate(deliveries):
            if i == 0:
                ttft.append(t - p.arrived_at)
            else:
                itl += [(t - deliveries[i - 1][0]) / n] * n
            window_tokens += n if warmup_s <= t < duration_s else 0
    return {"throughput_tok_s": window_tokens / (duration_s - warmup_s),
            "ttft_p50_s": float(np.median(ttft)) if ttft else None,
            "itl_p50_s": float(np.median(itl)) if itl else None,
            "completed": sum(not p.rejected and bool(p.deliveries) for p in played),
            "rejected": sum(p.rejected for p in played), "arrived": len(played)}


def relative_errors(simulated: dict, real: dict) -> dict:
    return {k: simulated[k] / real[k] - 1 if simulated[k] is not None and real[k] else None for k in FIGURES}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(FIGURES), figsize=(4.5 * len(FIGURES), 3.8))
    rates = [r["rate"] for r in rows]
    for ax, name in zip(axes, FIGURES):
        for side, style in (("real", "o-"), ("simulated", "s--")):
            ax.plot(rates, [r[side][name] or float("nan") for r in rows], style, label=side)
        for r in rows:
            err = r["relative_error"][name]
            if err is not None:
                ax.annotate(f"{err:+.0%}", (r["rate"], r["simulated"][name]), fontsize=8,
                            textcoords="offset points", xytext=(4, 4))
        ax.set_xlabel("offered requests/s")
        ax.set_title(name)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle("simulator vs the real 2-worker deployment (Poisson trace; labels: simulated / real - 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="0.5,1,2" if SHORT else "0.3,0.6,0.9", help="requests/s, a list")
    p.add_argument("--duration-s", type=float, default=4.0 if SHORT else 60.0)
    p.add_argument("--warmup-s", type=float, default=1.0 if SHORT else 10.0)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=16 if SHORT else 64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "simulate_validation", help="OUT.json, OUT.png")
    a = p.parse_args()
    rates = [float(r) for r in a.rates.split(",")]
    cores = sorted(os.sched_getaffinity(0))[:2]
    config = cluster_config("validate", [[c] for c in cores], ns.ClusterConfig().stream_interval_ms, ENGINE)
    ray.init(num_cpus=len(os.sched_getaffinity(0)), resources=config.ray_resources("validate"))
    client = ns.serve(config, model=str(random_checkpoint(MODEL)), name="validate-simulator")
    params = ns.SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    play(client, make_trace("poisson", 4.0, 1.0, a.seed + 1, a.prompt_len, a.max_tokens), params)  # warm-up
    cost = worker_step_cost(default_step_cost(), len(cores), len(cores))
    engine = EngineConfig(max_model_len=MAX_MODEL_LEN, **ENGINE)
    rows = []
    for rate in rates:
        arrivals = make_trace("poisson", rate, a.duration_s, a.seed, a.prompt_len, a.max_tokens)
        real = figures(play(client, arrivals, params), a.duration_s, a.warmup_s)
        sim = SimConfig(workers=len(cores), machines=1, rate=rate, duration_s=a.duration_s,
                        warmup_s=a.warmup_s, trace="poisson", seed=a.seed, prompt_len=a.prompt_len,
                        max_tokens=a.max_tokens, engine=engine,
                        max_queued_per_worker=config.max_queued_per_worker,
                        telemetry_interval_s=config.telemetry_interval_s,
                        target_step_s=config.target_step_ms / 1000,
                        stream_interval_s=config.stream_interval_ms / 1000, step_cost=cost)
        simulated = {k: v for k, v in simulate(sim).items() if k in real}
        rows.append({"rate": rate, "real": real, "simulated": simulated,
                     "relative_error": relative_errors(simulated, real)})
        print(json.dumps(rows[-1]), flush=True)
    client.shutdown()
    ray.shutdown()
    meta = {"model": MODEL, "engine": ENGINE, "workers": len(cores), "cores": cores, "short": SHORT,
            "duration_s": a.duration_s, "warmup_s": a.warmup_s, "prompt_len": a.prompt_len,
            "max_tokens": a.max_tokens, "seed": a.seed, "step_cost": cost.source,
            "date": time.strftime("%Y-%m-%d %H:%M")}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    plot(rows, a.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
