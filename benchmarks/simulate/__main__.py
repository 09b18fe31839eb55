"""python -m benchmarks.simulate: one simulated run, its figures as JSON (stdout, and --json OUT)."""

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.simulate.config import SimConfig
from benchmarks.simulate.simulator import simulate
from benchmarks.simulate.step_cost import PRESETS, DeploymentCost


def parse_config(argv: list[str] | None = None) -> tuple[SimConfig, Path | None]:
    p = argparse.ArgumentParser(prog="python -m benchmarks.simulate", description=__doc__)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--machines", type=int, default=1)
    p.add_argument("--rate", type=float, default=2.0, help="requests/s offered")
    p.add_argument("--duration-s", type=float, default=10.0)
    p.add_argument("--warmup-s", type=float, default=2.0, help="throughput counts tokens after it")
    p.add_argument("--trace", choices=("poisson", "bursty", "sessions", "adapters"), default="poisson")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=("relay", "placement"), default="placement")
    p.add_argument("--no-admission", action="store_true", help="no admission bound")
    p.add_argument("--no-stickiness", action="store_true", help="no session stickiness")
    p.add_argument("--no-prefix-affinity", action="store_true")
    p.add_argument("--speculation", choices=("off", "auto"), default="off")
    p.add_argument("--accept-rate", type=float, default=0.6)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--machine", choices=sorted(PRESETS), default="this_machine", help="step cost preset")
    p.add_argument("--router-chunk-ms", type=float, default=DeploymentCost().router_chunk_s * 1e3,
                   help="router CPU per relayed chunk")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    cfg = SimConfig(workers=a.workers, machines=a.machines, rate=a.rate, duration_s=a.duration_s,
                    warmup_s=a.warmup_s, trace=a.trace, seed=a.seed, routing=a.routing,
                    admission=not a.no_admission, stickiness=not a.no_stickiness,
                    prefix_affinity=not a.no_prefix_affinity, speculation=a.speculation,
                    accept_rate=a.accept_rate, prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                    step_cost=PRESETS[a.machine](),
                    deployment_cost=DeploymentCost(router_chunk_s=a.router_chunk_ms / 1e3))
    return cfg, a.json


def main(argv: list[str] | None = None) -> None:
    cfg, out = parse_config(argv)
    start = time.perf_counter()
    result = simulate(cfg)
    print(f"simulated in {time.perf_counter() - start:.1f} s", file=sys.stderr)  # not in the JSON: it varies
    text = json.dumps(result, indent=1)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
