"""Static (calibrated, per-tensor) against dynamic (per 32-value block) int8 activation scales.

Quality: perplexity of the shipped demo model on its model card's held-out set (128 windows of 256 tokens,
numaserve/demo_eval.py) with q8_0 and q4_0 weights: float32 activations, int8 with dynamic scales, and
int8 with static scales by `minmax`, `percentile` (99.99) and `kl` calibrated on the default calibration
text (32 windows of the same held-out stream: an optimistic setting for static scales); static scales both
everywhere and (q8_0) with the calibration's fallback (float32 where the static error exceeds the bound)
over a sweep of bounds, which is where the default bound comes from.
Speed: the engine on a TinyLlama-1.1B-shaped random checkpoint (q8_0 and q4_0, int8 activations): decode
at batch 1 and 8 and a 256-token prefill, the same engine switching between the two scale modes (the same
packed weights) sample by sample, the order flipping every sample; medians.

    python -m benchmarks.bench_calibration                      # about 5 minutes on 2 cores
    python -m benchmarks.bench_calibration --model llama-56m --samples 3 --skip-quality    # smoke run

Writes benchmarks/results/calibration.json and calibration.png.
"""

import argparse
import dataclasses
import json
import math
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from benchmarks.checkpoints import random_checkpoint
from cluster_configs.diagnostics import DecisionLog
from memory.matrices import Int8Matrix
from memory.weights import ModelWeights
from models.loader import load_model
from models.quantization.activation_plan import plan_activations, with_linear_matrices
from models.quantization.activation_ranges import METHODS
from models.quantization.calibrate import WindowRunner, calibrate
from models.quantization.calibration import CalibrationOptions
from numaserve.demo import DEMO_DIR
from numaserve.demo_corpus import heldout_texts
from numaserve.demo_eval import card_windows, perplexity

RESULTS = Path(__file__).parent / "results"
WEIGHT_DTYPES = ("q8_0", "q4_0")
BOUNDS = (0.01, 0.02, 0.05)  # static scales with fallback above these, q8_0 weights only (time)
SWEEP_METHODS = ("percentile", "kl")
DECODE_PROMPT_LEN, DECODE_STEPS, PREFILL_LEN = 16, 32, 256


def quality(weight_dtype: str, windows: list[np.ndarray], texts: list[str]) -> dict:
    base = DEMO_DIR / "base"
    spec, weights, _ = load_model(base, weight_dtype)

    def ppl(planned: dict) -> float:
        runner = WindowRunner(spec, planned)
        return perplexity(lambda ids: runner.forward(np.asarray(ids)), windows)

    exact = ppl(weights)
    rows = {"float32": exact, "int8 dynamic": ppl(plan_activations(weights, "int8", DecisionLog()))}
    calibrations = {}
    for method in METHODS:
        cal = calibrate(base, texts, "the demo model card's held-out set", CalibrationOptions(method=method,
                                                                                             weight_dtype=weight_dtype))
        calibrations[method] = cal
        everywhere = cal.model_copy(update={"bound": math.inf})
        rows[f"int8 static {method}"] = ppl(plan_activations(weights, "int8", DecisionLog(),
                                                             everywhere, True))
    sweep = []
    for method in SWEEP_METHODS if weight_dtype == WEIGHT_DTYPES[0] else ():
        for bound in BOUNDS:
            cal = calibrations[method].model_copy(update={"bound": bound})
            fallbacks = [n for n, m in cal.matrices.items() if m.error_static > bound]
            sweep.append({"method": method, "bound": bound, "num_fallbacks": len(fallbacks),
                          "perplexity": ppl(plan_activations(weights, "int8", DecisionLog(), cal, True))})
    errors = {method: {"max_error_dynamic": max(m.error_dynamic for m in cal.matrices.values()),
                       "max_error_static": max(m.error_static for m in cal.matrices.values()),
                       "per_matrix": {n: [round(m.error_dynamic, 5), round(m.error_static, 5)]
                                      for n, m in cal.matrices.items()}}
              for method, cal in calibrations.items()}
    for row in sweep:
        row["vs_float32"] = row["perplexity"] / exact - 1
    out = {"perplexity": rows, "vs_float32": {k: v / exact - 1 for k, v in rows.items()},
           "static_with_fallback": sweep, "errors": errors,
           "num_matrices": len(calibrations["minmax"].matrices)}
    print(json.dumps({"weight_dtype": weight_dtype, "perplexity": rows, "vs_float32": out["vs_float32"]}))
    return out


def speed(model: str, weight_dtype: str, samples: int, threads: int) -> dict:
    from benchmarks.numaserve_worker import NumaserveBench

    args = argparse.Namespace(model_dir=str(random_checkpoint(model)), weight_dtype=weight_dtype,
                              activation_dtype="int8", max_num_seqs=8, threads=threads)
    bench = NumaserveBench(args)
    model_ = bench.engine.model
    dynamic = model_.weights
    static = _with_static_scales(bench, dynamic)
    rng = np.random.default_rng(0)
    loads = {"prefill_256": (lambda p: bench.prefill(p), rng.integers(3, 32000, PREFILL_LEN).tolist(),
                             PREFILL_LEN)}
    for batch in (1, 8):
        prompts = [rng.integers(3, 32000, DECODE_PROMPT_LEN).tolist() for _ in range(batch)]
        loads[f"decode_b{batch}"] = (lambda p: bench.decode(p, DECODE_STEPS), prompts, batch * DECODE_STEPS)
    bench.decode([[5] * 16] * 2, 2)  # warm-up: every kernel signature compiled or loaded
    times = {name: {"dynamic": [], "static": []} for name in loads}
    for s in range(samples):
        for name, (run, arg, _) in loads.items():
            for mode in (("dynamic", "static") if s % 2 == 0 else ("static", "dynamic")):
                model_.weights = dynamic if mode == "dynamic" else static
                times[name][mode].append(run(arg))
    model_.weights = dynamic
    out = {}
    for name, (_, _, num_tokens) in loads.items():
        med = {mode: statistics.median(t) for mode, t in times[name].items()}
        out[name] = {f"{mode}_tok_s": num_tokens / med[mode] for mode in med} | {
            "static_over_dynamic": med["dynamic"] / med["static"], "seconds": times[name]}
        print(json.dumps({"weight_dtype": weight_dtype, "workload": name,
                          **{k: v for k, v in out[name].items() if k != "seconds"}}))
    return out


def _with_static_scales(bench, dynamic: ModelWeights) -> ModelWeights:
    """The same packed weights with minmax static scales measured over one random 256-token prefill."""
    model_ = bench.engine.model
    absmax: dict[str, float] = {}

    def observe(name, x):
        absmax[name] = max(absmax.get(name, 0.0), float(np.abs(x).max()))

    model_.observer = observe
    bench.prefill(np.random.default_rng(1).integers(3, 32000, PREFILL_LEN).tolist())
    model_.observer = None

    def scaled(name, w):
        return dataclasses.replace(w, activation_scale=absmax[name] / 127) if isinstance(w, Int8Matrix) else w

    return with_linear_matrices(dynamic, scaled)


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    quality_rows = result.get("quality", {})
    if quality_rows:
        labels = list(next(iter(quality_rows.values()))["vs_float32"])[1:]
        x = np.arange(len(labels))
        for i, (wd, q) in enumerate(quality_rows.items()):
            vals = [100 * q["vs_float32"][k] for k in labels]
            left.bar(x + (i - 0.5) * 0.4, vals, 0.4, label=f"{wd} weights")
        left.axhline(0.3, color="tab:red", ls="--", lw=1, label="0.3% bound")
        left.set_xticks(x, labels, rotation=15)
        left.set_ylabel("perplexity vs float32 activations (%)")
        left.set_title("demo model, held-out set (128 x 256 tokens)")
        left.legend()
    speed_rows = result.get("speed", {})
    if speed_rows:
        names = [(wd, w) for wd, rows in speed_rows.items() for w in rows]
        x = np.arange(len(names))
        for j, mode in enumerate(("dynamic", "static")):
            right.bar(x + (j - 0.5) * 0.4, [speed_rows[wd][w][f"{mode}_tok_s"] for wd, w in names], 0.4,
                      label=f"{mode} scales")
        right.set_xticks(x, [f"{wd}\n{w}" for wd, w in names], fontsize=8)
        right.set_ylabel("tokens/s (median)")
        right.set_title(f"TinyLlama-shaped, int8 activations, {result['meta']['threads']} threads")
        right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tinyllama-1.1b",
                        help="random checkpoint shape for the speed part")
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args(argv)
    result = {"meta": {"model": args.model, "samples": args.samples, "threads": args.threads,
                       "cpu": platform.processor() or platform.machine(),
                       "time": time.strftime("%Y-%m-%d %H:%M"),
                       "command": "python -m benchmarks.bench_calibration"}}
    if not args.skip_quality:
        from models.tokenizer import Tokenizer

        windows = card_windows(Tokenizer.from_dir(DEMO_DIR / "base"))
        texts = heldout_texts()
        result["quality"] = {wd: quality(wd, windows, texts) for wd in WEIGHT_DTYPES}
    if not args.skip_speed:
        result["speed"] = {wd: speed(args.model, wd, args.samples, args.threads) for wd in WEIGHT_DTYPES}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "calibration.json").write_text(json.dumps(result, indent=1))
    plot(result, RESULTS / "calibration.png")


if __name__ == "__main__":
    main()
