"""Speculative decoding benchmarks (issue 11), two parts:

acceptance: the demo model family (numaserve/assets/demo/base, drafted by .../draft or by n-gram lookup) on
    its held-out standard-library files, with copy-heavy prompts (a file cut where its next lines repeat
    earlier ones; a function restated after an instruction-like comment) and plain continuation: acceptance
    per draft position and decode tokens/s at batch 1 and 16, each against no speculation, greedy, engines
    alternating sample by sample (medians).

    python -m benchmarks.bench_speculation acceptance          # about 4 minutes on 2 cores
    python -m benchmarks.bench_speculation acceptance --num-prompts 4 --samples 1   # smoke run, < 1 minute

sweep: speed vs acceptance on the TinyLlama-shaped random checkpoint (q8_0 and bfloat16), see
    benchmarks/spec_sweep.py.

    python -m benchmarks.bench_speculation sweep               # about 10 minutes on 2 cores
    python -m benchmarks.bench_speculation sweep --full        # depths 1..8, about 25 minutes

coupling: how often a sampled draft is accepted, the keyed race against the standard rejection rule (no
    timing), see benchmarks/spec_coupling.py.

    python -m benchmarks.bench_speculation coupling

heads: Medusa and EAGLE (chain and tree) beside n-gram and the draft model on the demo model, then on the
    TinyLlama shape at the demo model's acceptance, see benchmarks/spec_heads.py.

    python -m benchmarks.bench_speculation heads demo
    python -m benchmarks.bench_speculation heads tinyllama

Writes benchmarks/results/speculation_acceptance.{json,png} and speculation_sweep.{json,png}, one JSON
line per point on stdout. Run `acceptance` first: the sweep adds a point at the acceptance it measured.
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numaserve as ns
from benchmarks.heldout_prompts import KINDS, build_prompts
from benchmarks.spec_common import RecordingProposer, find_proposer, install_proposer, run_decode, spec_stats

RESULTS = Path(__file__).parent / "results"
DEMO = Path(ns.__file__).parent / "assets" / "demo"
PROMPT_TOKENS = 192  # the demo models were trained on 256-token windows: prompt + output stay inside one


def demo_engines(depth: int) -> dict[str, ns.LLM]:
    common = {"max_num_seqs": 16, "max_model_len": 512, "max_num_batched_tokens": 2048}
    configs = {"off": None,
               "ngram": {"method": "ngram", "num_speculative_tokens": depth, "mode": "on"},
               "ngram-auto": {"method": "ngram", "num_speculative_tokens": depth, "mode": "auto"},
               "draft": {"method": "draft", "num_speculative_tokens": depth, "mode": "on",
                         "draft_model": str(DEMO / "draft")},
               "draft-auto": {"method": "draft", "num_speculative_tokens": depth, "mode": "auto",
                              "draft_model": str(DEMO / "draft")}}
    llms = {}
    for name, spec in configs.items():
        llms[name] = ns.LLM(DEMO / "base", **common, **({"speculation": spec} if spec else {}))
        if spec:
            engine = llms[name].engine
            install_proposer(engine, RecordingProposer(getattr(*find_proposer(engine))))
    return llms


def run_batch(llm: ns.LLM, prompts: list[str], batch: int, max_tokens: int) -> dict:
    """Decode every prompt, `batch` at a time; -> decode tokens, seconds and final token ids."""
    params = ns.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    total = {"tokens": 0, "seconds": 0.0, "final": {}, "outputs": []}
    for i in range(0, len(prompts), batch):
        run = run_decode(llm.engine, prompts[i:i + batch], params)
        total["tokens"] += run["tokens"]
        total["seconds"] += run["seconds"]
        total["final"] |= run["final"]
        total["outputs"] += run["outputs"]
    return total


def acceptance(args) -> None:
    llms = demo_engines(args.depth)
    tokenizer = llms["off"].tokenizer
    prompts = {kind: build_prompts(tokenizer, kind, args.num_prompts, PROMPT_TOKENS) for kind in KINDS}
    for llm in llms.values():  # warm-up: numba compiles every kernel signature once
        run_batch(llm, prompts["plain"][:2], 2, 4)
    rows = []
    for kind in KINDS:
        for batch in (1, args.batch):
            names = list(llms)
            times = {name: [] for name in names}
            recorded = {name: [] for name in names}
            outputs = {}
            for s in range(args.samples):
                for name in (names if s % 2 == 0 else names[::-1]):
                    run = run_batch(llms[name], prompts[kind], batch, args.max_tokens)
                    times[name].append(run["tokens"] / run["seconds"])
                    outputs[name] = run["outputs"]
                    proposer = _recorder(llms[name])
                    if proposer is not None:
                        recorded[name].append(proposer.acceptance(run["final"], args.depth))
            off = statistics.median(times["off"])
            for name in names:
                tok_s = statistics.median(times[name])
                row = {"kind": kind, "batch": batch, "engine": name, "tokens_per_s": tok_s,
                       "speedup_vs_off": tok_s / off, "samples_tokens_per_s": times[name],
                       "same_tokens_as_off": outputs[name] == outputs["off"]}
                if recorded[name]:
                    row |= _merge(recorded[name]) | {"engine_stats": spec_stats(llms[name].engine)}
                print(json.dumps(row))
                rows.append(row)
    meta = {"model": str(DEMO / "base"), "draft_model": str(DEMO / "draft"), "depth": args.depth,
            "num_prompts": args.num_prompts, "max_tokens": args.max_tokens, "prompt_tokens": PROMPT_TOKENS,
            "samples": args.samples, "temperature": 0.0, "threads": llms["off"].engine.config.num_threads,
            "cpu": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M")}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculation_acceptance.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot_acceptance(rows, args.depth, RESULTS / "speculation_acceptance.png")


def _recorder(llm: ns.LLM) -> RecordingProposer | None:
    found = find_proposer(llm.engine)
    proposer = getattr(*found) if found else None
    return proposer if isinstance(proposer, RecordingProposer) else None


def _merge(records: list[dict]) -> dict:
    verified = [sum(col) for col in zip(*(r["verified_per_position"] for r in records))]
    accepted = [sum(col) for col in zip(*(r["accepted_per_position"] for r in records))]
    drafted = sum(r["num_draft_tokens"] for r in records)
    return {"accept_rate_per_position": [a / v if v else None for a, v in zip(accepted, verified)],
            "verified_per_position": verified, "accepted_per_position": accepted, "num_draft_tokens": drafted,
            "accepted_per_draft_token": sum(accepted) / max(1, drafted),
            "tokens_per_verification": 1 + sum(accepted) / max(1, verified[0])}


def plot_acceptance(rows: list[dict], depth: int, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    styles = {"copy": "-", "edit": "--", "plain": ":"}
    for row in rows:
        if row["batch"] == 1 and row["engine"] in ("ngram", "draft"):
            rates = [r if r is not None else float("nan") for r in row["accept_rate_per_position"]]
            ax1.plot(range(1, depth + 1), rates, styles[row["kind"]], marker="o",
                     color="tab:blue" if row["engine"] == "ngram" else "tab:orange",
                     label=f"{row['engine']}, {row['kind']}")
    ax1.set_xlabel("draft position")
    ax1.set_ylabel("acceptance (given the earlier drafts accepted)")
    ax1.set_ylim(0, 1)
    ax1.set_xticks(range(1, depth + 1))
    ax1.legend(fontsize=8)
    ax1.set_title("Demo model, held-out stdlib code, greedy")
    engines = [e for e in dict.fromkeys(r["engine"] for r in rows) if e != "off"]
    groups = [(k, b) for k in KINDS for b in sorted({r["batch"] for r in rows})]
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        speedup = {(r["kind"], r["batch"]): r["speedup_vs_off"] for r in rows if r["engine"] == engine}
        values = [speedup.get(g, 0) for g in groups]
        ax2.bar([g + j * width for g in range(len(groups))], values, width, label=engine)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], [f"{k}\nbatch {b}" for k, b in groups])
    ax2.set_ylabel("decode tokens/s vs no speculation")
    ax2.legend(fontsize=8)
    ax2.set_title(f"Speed-up at depth {depth}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="part", required=True)
    a = sub.add_parser("acceptance")
    a.add_argument("--num-prompts", type=int, default=16)
    a.add_argument("--batch", type=int, default=16)
    a.add_argument("--max-tokens", type=int, default=48)
    a.add_argument("--depth", type=int, default=4)
    a.add_argument("--samples", type=int, default=3)
    s = sub.add_parser("sweep")
    from benchmarks.spec_sweep import add_arguments, sweep
    add_arguments(s)
    from benchmarks import spec_coupling, spec_heads
    spec_coupling.add_arguments(sub.add_parser("coupling"))
    spec_heads.add_arguments(sub.add_parser("heads"))
    args = parser.parse_args()
    if args.part == "acceptance":
        acceptance(args)
    elif args.part == "coupling":
        spec_coupling.coupling(args)
    elif args.part == "heads":
        spec_heads.main(args)
    else:
        sweep(args)


if __name__ == "__main__":
    main()
