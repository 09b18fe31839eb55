"""`numaserve simulate` (and `python -m benchmarks.simulate`): one simulated run, its figures as JSON
(stdout, and --json OUT)."""

import argparse
import json
import sys
import time
from pathlib import Path

from numaserve.simulate.config import SimConfig
from numaserve.simulate.simulator import simulate
from numaserve.simulate.step_cost import PRESETS, STEP_COST_JSON, DeploymentCost


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1, help="modelled workers (one per NUMA node)")
    p.add_argument("--tensor-parallel", type=int, default=1,
                   help="ranks a worker, each on its own NUMA node (--workers groups of them)")
    p.add_argument("--machines", type=int, default=1, help="machines the workers spread over (an HTTP "
                                                              "actor on each)")
    p.add_argument("--rate", type=float, default=2.0, help="requests a second offered")
    p.add_argument("--duration-s", type=float, default=10.0, help="simulated seconds of arrivals")
    p.add_argument("--warmup-s", type=float, default=2.0, help="simulated seconds before throughput counts "
                                                               "tokens (less than --duration-s)")
    p.add_argument("--trace", choices=("poisson", "bursty", "sessions", "adapters"), default="poisson",
                   help="arrival pattern: poisson, bursty, multi-turn sessions, or requests over adapters")
    p.add_argument("--seed", type=int, default=0, help="the trace's random seed (same seed, same figures)")
    p.add_argument("--routing", choices=("relay", "placement"), default="placement",
                   help="placement: tokens stream from the worker to the caller; relay: through the router")
    p.add_argument("--no-admission", action="store_true", help="no admission bound (default: bounded)")
    p.add_argument("--no-stickiness", action="store_true",
                   help="no session stickiness (default: a session's turns go to its worker)")
    p.add_argument("--no-prefix-affinity", action="store_true",
                   help="no prefix affinity (default: a prompt goes where its prefix is cached)")
    p.add_argument("--speculation", choices=("off", "auto"), default="off",
                   help="auto: the speculation policy drafts with a modelled n-gram proposer")
    p.add_argument("--accept-rate", type=float, default=0.6, help="the modelled proposer's acceptance rate")
    p.add_argument("--prompt-len", type=int, default=128, help="prompt tokens a request")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens a request generates")
    p.add_argument("--machine", choices=sorted(PRESETS), default="this_machine",
                   help="step cost preset: this machine's, or projected to a 2 x 32-core box")
    p.add_argument("--step-cost", type=Path, default=STEP_COST_JSON,
                   help="a fitted step-cost model (python -m benchmarks.fit_step_cost); absent: a built-in "
                        "guess (default: a source checkout's benchmarks/results/step_cost.json)")
    p.add_argument("--router-chunk-ms", type=float, default=DeploymentCost().router_chunk_s * 1e3,
                   help="router CPU milliseconds per relayed chunk")
    p.add_argument("--json", type=Path, default=None, help="also write the figures to this file (default: "
                                                            "stdout only)")


def config_from(a: argparse.Namespace) -> SimConfig:
    """The run's SimConfig from add_arguments' options (ValueError names a bad value)."""
    return SimConfig(workers=a.workers, tensor_parallel=a.tensor_parallel, machines=a.machines, rate=a.rate,
                     duration_s=a.duration_s, warmup_s=a.warmup_s, trace=a.trace, seed=a.seed,
                     routing=a.routing, admission=not a.no_admission, stickiness=not a.no_stickiness,
                     prefix_affinity=not a.no_prefix_affinity, speculation=a.speculation,
                     accept_rate=a.accept_rate, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                     step_cost=PRESETS[a.machine](a.step_cost),
                     deployment_cost=DeploymentCost(router_chunk_s=a.router_chunk_ms / 1e3))


def run(cfg: SimConfig, out: Path | None) -> None:
    start = time.perf_counter()
    result = simulate(cfg)
    print(f"simulated in {time.perf_counter() - start:.1f} s", file=sys.stderr)  # not in the JSON: it varies
    text = json.dumps(result, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


def main(a: argparse.Namespace) -> None:
    """Simulate the run add_arguments' options describe (the CLI's and the checkout's entry point)."""
    run(config_from(a), a.json)
