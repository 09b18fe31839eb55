"""Fit the simulator's StepCostModel (numaserve/simulate/step_cost.py) to the real engine's step times.

    python -m benchmarks.fit_step_cost [--model tinyllama-1.1b] [--repeats 5] [--json OUT]
    python -m benchmarks.fit_step_cost --refit SAMPLES.json [--json OUT]  # an earlier run's samples

On the random-weight TinyLlama-shaped checkpoint (benchmarks/checkpoints.py) in q8_0 with int8 activations,
for each point of a grid of (decode rows B, their context length C, prefill tokens P): B requests of C-token
prompts are prefilled, then `repeats` steps are timed that run the B decode rows and, when P > 0, a fresh
P-token prompt in the same step (aborted after it, so the next step is the same shape again). Each point's
median step time is one sample; StepCostModel's constants come from benchmarks/simulate/step_cost_fit.py
(least squares on log time), with each group's relative errors (batch-1 decode, batched decode, prefill) in
the JSON's meta. Draft rows are not timed here: a verified draft is a flat-batch row attending to its
request's context, priced as a decode row. Writes benchmarks/results/step_cost.json, which the simulator then
reads as its default. Run it alone on the machine: every sample is a wall time.
"""

import argparse
import json
import platform
import statistics
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import random_checkpoint
from benchmarks.machine import cpu_name
from benchmarks.simulate.step_cost_fit import fit, relative_errors
from cluster_configs.engine_config import EngineConfig
from cluster_configs.sampling_params import SamplingParams
from numaserve.simulate.step_cost import FITTED, STEP_COST_JSON
from scheduling.engine import Engine

DECODE_ROWS = (1, 2, 4, 8, 16, 32)
CONTEXTS = (64, 512)
PREFILLS = (0, 32, 128, 512)


def time_points(engine: Engine, num_rows: int, context: int, prefills: list[int], repeats: int,
                rng: np.random.Generator) -> list[dict]:
    """Per prefill size P: the median seconds of `repeats` steps of num_rows decode rows (prompts of
    `context` tokens) plus a fresh P-token prompt."""
    params = SamplingParams(max_tokens=1 << 20, temperature=0, ignore_eos=True)
    ids = [f"d{num_rows}-{context}-{i}" for i in range(num_rows)]
    for request_id in ids:
        engine.add_request(request_id, rng.integers(3, 32000, context).tolist(), params)
    while any(r.num_computed_tokens + 1 < r.num_tokens for r in engine.scheduler.requests.values()):
        engine.step()  # prefill them (and their first tokens)
    points = []
    for num_prefill in prefills:
        seconds, contexts = [], []
        for k in range(repeats):
            contexts.append(sum(engine.scheduler.requests[i].num_computed_tokens for i in ids))
            if num_prefill:
                engine.add_request(f"p{k}", rng.integers(3, 32000, num_prefill).tolist(), params)
            start = time.perf_counter()
            engine.step()
            seconds.append(time.perf_counter() - start)
            if num_prefill:
                engine.abort(f"p{k}")
        points.append({"decode_rows": num_rows, "prefill_tokens": num_prefill,
                       "context_tokens": statistics.median(contexts), "seconds": statistics.median(seconds)})
        print(points[-1], flush=True)
    for request_id in ids:
        engine.abort(request_id)
    return points


def measure(a: argparse.Namespace) -> tuple[dict, list[dict]]:
    """This machine's samples over the grid -> (meta, samples)."""
    from benchmarks.bench_revisions import revision

    rows, contexts, prefills = ([int(v) for v in arg.split(",")]
                                for arg in (a.decode_rows, a.contexts, a.prefills))
    config = EngineConfig(weight_dtype="q8_0", activation_dtype="int8", max_model_len=2048,
                          max_num_batched_tokens=max(rows) + max(prefills), max_num_seqs=max(rows) + 1,
                          enable_prefix_caching=False)
    engine = Engine(random_checkpoint(a.model), config)
    warm = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    engine.add_request("warm-up", [1, 2, 3], warm)
    while engine.has_unfinished():
        engine.step()  # kernels compiled (or loaded) outside the timed steps
    rng = np.random.default_rng(0)
    samples = []
    for num_rows in rows:
        for context in contexts:
            samples += time_points(engine, num_rows, context, prefills, a.repeats, rng)
    meta = {"model": a.model, "weight_dtype": "q8_0", "activation_dtype": "int8", "cpu": cpu_name(),
            "machine": platform.node(), "date": datetime.now().isoformat(timespec="minutes"),
            "commit": revision(Path(__file__).resolve().parents[1]), "repeats": a.repeats}
    return meta, samples


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tinyllama-1.1b", help="a benchmarks/checkpoints.py shape")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--decode-rows", default=",".join(map(str, DECODE_ROWS)))
    p.add_argument("--contexts", default=",".join(map(str, CONTEXTS)))
    p.add_argument("--prefills", default=",".join(map(str, PREFILLS)))
    p.add_argument("--refit", type=Path, default=None, help="fit its samples again")
    p.add_argument("--json", type=Path, default=STEP_COST_JSON)
    a = p.parse_args()
    if a.refit:
        earlier = json.loads(a.refit.read_text())
        meta = earlier["meta"] | {"fitted": {"from": a.refit.name,
                                             "date": datetime.now().isoformat(timespec="minutes")}}
        samples = earlier["samples"]
    else:
        meta, samples = measure(a)
    model = fit(samples, source=a.json.name)
    meta["fit"] = relative_errors(model, samples)  # per group: median and max |modelled / measured - 1|
    out = {"meta": meta, "model": {k: getattr(model, k) for k in FITTED}, "samples": samples}
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["model"]), json.dumps(meta["fit"], indent=1), sep="\n")


if __name__ == "__main__":
    main()
