"""Speed vs acceptance on the TinyLlama-shaped random checkpoint: where speculation pays and where not.

For each weight dtype and batch size, the target's greedy continuation of random prompts is computed once
without speculation; a ReplayProposer then drafts it with a chosen share of tokens corrupted, so the
engine verifies drafts at a known acceptance. Points: no speculation ("off"); mode "on" at each depth and
acceptance; mode "auto" (max depth = the deepest measured) at each acceptance, after a warm-up at that
acceptance so its EMA and cost fit have data; and, when benchmarks/results/speculation_acceptance.json
exists, the n-gram acceptance per position measured on the demo model's copy-heavy prompts at batch 1.
Each point times a fixed number of decode steps after an untimed prefill (tokens appended / seconds);
points alternate in order sample by sample and the medians are reported. Every run is checked to append
exactly the greedy continuation.

    python -m benchmarks.bench_speculation sweep [--dtypes q8_0,bfloat16] [--full]

Run through benchmarks/bench_speculation.py (the command above); writes speculation_sweep.{json,png}.
"""

import gc
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import numaserve as ns
from benchmarks.checkpoints import SHAPES, random_checkpoint
from benchmarks.replay_proposer import ReplayProposer
from benchmarks.spec_common import (
    find_proposer,
    forget_shared_weights,
    install_proposer,
    run_decode,
    share_weights,
    spec_stats,
)

RESULTS = Path(__file__).parent / "results"
GOAL_AUTO = 0.97  # auto >= 0.97x off everywhere
GOAL_NGRAM_B1 = 2.0  # batch 1 n-gram on copy-heavy prompts >= 2x off


def add_arguments(p) -> None:
    p.add_argument("--model", default="tinyllama-1.1b")
    p.add_argument("--dtypes", default="q8_0,bfloat16")
    p.add_argument("--depths", default="1,2,4,8")
    p.add_argument("--full", action="store_true", help="depths 1..8")
    p.add_argument("--rates", default="0,0.5,0.8,1.0")
    p.add_argument("--batches", default="1,32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", default="1:6,32:1", help="timed decode steps per point, per batch size")
    p.add_argument("--auto-warmup", default="1:8,32:2", help="untimed auto steps before each auto point")
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--acceptance", default=str(RESULTS / "speculation_acceptance.json"))


def measured_acceptance(path: str) -> tuple[int, list[float]] | None:
    """(depth, n-gram acceptance per position) on the copy-heavy prompts (copy + edit) at batch 1."""
    if not Path(path).exists():
        return None
    data = json.loads(Path(path).read_text())
    rows = [r for r in data["rows"]
            if r["engine"] == "ngram" and r["batch"] == 1 and r["kind"] in ("copy", "edit")]
    if not rows:
        return None
    verified = np.sum([r["verified_per_position"] for r in rows], axis=0)
    accepted = np.sum([r["accepted_per_position"] for r in rows], axis=0)
    return data["meta"]["depth"], [float(a / v) if v else 0.0 for a, v in zip(accepted, verified)]


def _per_batch(spec: str) -> dict[int, int]:
    return {int(b): int(n) for b, n in (item.split(":") for item in spec.split(","))}


def sweep(args) -> None:
    depths = list(range(1, 9)) if args.full else [int(d) for d in args.depths.split(",")]
    rates: list = [float(r) for r in args.rates.split(",")]
    measured = measured_acceptance(args.acceptance)
    if measured:
        rates.append("measured")
    steps, warmup = _per_batch(args.steps), _per_batch(args.auto_warmup)
    batches = [int(b) for b in args.batches.split(",")]
    vocab = SHAPES[args.model]["vocab_size"]
    path = random_checkpoint(args.model)
    rows, meta = [], {}
    share_weights()
    for dtype in args.dtypes.split(","):
        max_depth = max(depths + ([measured[0]] if measured else []))
        num_cont = max(steps[b] + warmup[b] for b in batches) * (max_depth + 1) + 8
        common = {"weight_dtype": dtype, "max_num_seqs": max(batches), "max_num_batched_tokens": 512,
                  "max_model_len": args.prompt_len + num_cont + 16}
        continuations: dict[tuple[int, ...], list[int]] = {}
        engines = build_engines(path, common, depths, max_depth, measured, rates, continuations, vocab)
        off = engines["off", 0, None]
        for b in batches:
            rng = np.random.default_rng(b)
            prompts = [rng.integers(3, vocab, args.prompt_len).tolist() for _ in range(b)]
            params = ns.SamplingParams(max_tokens=num_cont, temperature=0.0, ignore_eos=True)
            run_decode(off.engine, prompts[:2], params.model_copy(update={"max_tokens": 3}))  # warm-up
            reference = run_decode(off.engine, prompts, params)
            for prompt, out in zip(prompts, reference["outputs"]):
                continuations[tuple(prompt)] = out
            points = [("off", 0, None, None)]
            points += [("on", d, None, r) for d in depths for r in rates if r != "measured"]
            if measured:
                points.append(("on", measured[0], None, "measured"))
            points += [("auto", max_depth, r, r) for r in rates]
            for mode, d, key_rate, rate in points:  # warm-up: every engine compiles and fits once
                _run_point(engines[mode, d, key_rate], prompts, params, 1, rate, measured)
            samples = {p: [] for p in points}
            runs = {p: [] for p in points}
            for s in range(args.samples):
                for point in (points if s % 2 == 0 else points[::-1]):
                    mode, d, key_rate, rate = point
                    llm = engines[mode, d, key_rate]
                    if mode == "auto":
                        _run_point(llm, prompts, params, warmup[b], rate, measured)
                    run = _run_point(llm, prompts, params, steps[b], rate, measured)
                    samples[point].append(run["tokens"] / run["seconds"])
                    exact = all(out == continuations[tuple(p)][:len(out)]
                                for p, out in zip(prompts, run["outputs"]))
                    per_step = run["tokens"] / max(1, run["steps"]) / b
                    runs[point].append({"tokens_per_step": per_step, "exact": exact})
            off_tok_s = statistics.median(samples["off", 0, None, None])
            for point in points:
                mode, d, key_rate, rate = point
                tok_s = statistics.median(samples[point])
                row = {"dtype": dtype, "batch": b, "mode": mode, "depth": d, "accept_rate": rate,
                       "tokens_per_s": tok_s, "speedup_vs_off": tok_s / off_tok_s,
                       "tokens_per_step_per_request": statistics.mean(r["tokens_per_step"]
                                                                      for r in runs[point]),
                       "exact": all(r["exact"] for r in runs[point]), "samples_tokens_per_s": samples[point]}
                if mode == "auto":
                    row["engine_stats"] = spec_stats(engines[mode, d, key_rate].engine)
                print(json.dumps(row))
                rows.append(row)
        meta[dtype] = {"threads": off.engine.config.num_threads, "kv_dtype": off.config.resolved_kv_dtype}
        del engines, off
        forget_shared_weights()
        gc.collect()
    result = {"meta": {"model": args.model, "depths": depths, "rates": rates, "steps": steps,
                       "auto_warmup": warmup, "samples": args.samples, "prompt_len": args.prompt_len,
                       "measured_acceptance": measured,
                       "per_dtype": meta, "cpu": platform.processor() or platform.machine(),
                       "date": time.strftime("%Y-%m-%d %H:%M")},
              "goals": goals(rows), "rows": rows}
    print(json.dumps({"goals": result["goals"]}))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculation_sweep.json").write_text(json.dumps(result, indent=2))
    plot_sweep(rows, RESULTS / "speculation_sweep.png")


def build_engines(path, common: dict, depths: list[int], max_depth: int, measured, rates: list,
                  continuations: dict, vocab: int) -> dict[tuple, ns.LLM]:
    """(mode, depth, rate of an auto engine) -> engine: one off, one "on" per depth, one "auto" per rate
    (each auto engine's acceptance EMA sees only its own rate). All share one copy of the weights."""

    def speculating(mode: str, depth: int) -> ns.LLM:
        spec = {"method": "ngram", "num_speculative_tokens": depth, "mode": mode}
        llm = ns.LLM(path, **common, speculation=spec)
        install_proposer(llm.engine, ReplayProposer(continuations, 0.0, vocab))  # rate set per point
        return llm

    engines = {("off", 0, None): ns.LLM(path, **common)}
    for d in sorted(set(depths) | ({measured[0]} if measured else set())):
        engines["on", d, None] = speculating("on", d)
    for rate in rates:
        engines["auto", max_depth, rate] = speculating("auto", max_depth)
    return engines


def _run_point(llm: ns.LLM, prompts, params, num_steps: int, rate, measured) -> dict:
    if rate is not None:
        getattr(*find_proposer(llm.engine)).accept_rates = measured[1] if rate == "measured" else rate
    return run_decode(llm.engine, prompts, params, num_steps)


def goals(rows: list[dict]) -> dict:
    off = {(r["dtype"], r["batch"]): r["tokens_per_s"] for r in rows if r["mode"] == "off"}
    auto = [r for r in rows if r["mode"] == "auto"]
    out = {}
    if auto:
        worst = min(auto, key=lambda r: r["speedup_vs_off"])
        where = {k: worst[k] for k in ("dtype", "batch", "accept_rate")}
        out["auto_min_vs_off"] = {"value": worst["speedup_vs_off"], "at": where,
                                  "met": worst["speedup_vs_off"] >= GOAL_AUTO}
        big = [r for r in auto if r["batch"] == max(b for _, b in off)]
        out["auto_vs_off_at_max_batch"] = {"min": min(r["speedup_vs_off"] for r in big),
                                           "met": min(r["speedup_vs_off"] for r in big) >= GOAL_AUTO}
    ngram = [r for r in rows if r["accept_rate"] == "measured" and r["batch"] == 1 and r["mode"] == "on"]
    if ngram:
        out["ngram_copy_heavy_b1_vs_off"] = {r["dtype"]: r["speedup_vs_off"] for r in ngram}
        out["ngram_copy_heavy_b1_met"] = all(r["speedup_vs_off"] >= GOAL_NGRAM_B1 for r in ngram)
    out["all_exact"] = all(r["exact"] for r in rows)
    return out


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dtypes = list(dict.fromkeys(r["dtype"] for r in rows))
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(len(dtypes), len(batches), figsize=(6 * len(batches), 4 * len(dtypes)),
                             squeeze=False)
    rates = list(dict.fromkeys(r["accept_rate"] for r in rows if r["mode"] != "off"))
    colors = dict(zip(rates, plt.cm.viridis(np.linspace(0, 0.9, len(rates)))))
    for i, dtype in enumerate(dtypes):
        for j, b in enumerate(batches):
            ax = axes[i][j]
            sel = [r for r in rows if r["dtype"] == dtype and r["batch"] == b]
            off = next(r["tokens_per_s"] for r in sel if r["mode"] == "off")
            ax.axhline(off, color="k", ls="--", label="off")
            for rate in rates:
                on = sorted((r["depth"], r["tokens_per_s"]) for r in sel
                            if r["mode"] == "on" and r["accept_rate"] == rate)
                if on:
                    ax.plot(*zip(*on), "o-", color=colors[rate], label=f"on, acceptance {rate}")
                auto = [r["tokens_per_s"] for r in sel if r["mode"] == "auto" and r["accept_rate"] == rate]
                if auto:
                    ax.axhline(auto[0], color=colors[rate], ls=":", label=f"auto, acceptance {rate}")
            ax.set_xlabel("draft depth (mode on)")
            ax.set_ylabel("decode tokens/s")
            ax.set_title(f"{dtype}, batch {b}")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    fig.suptitle("Speculative decoding on a TinyLlama-shaped model: replayed drafts at a set acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
