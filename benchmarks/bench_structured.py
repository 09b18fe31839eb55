"""Structured-output speed: output tokens/s of greedy requests constrained to a JSON Schema against the same
requests unconstrained, at batch 1 and 16, on the TinyLlama shape's random checkpoint in q8_0 with int8
activations (as bench_decode runs it).

Rows: a schema of free-form fields (strings and numbers) and a fixed-key schema (enums, a boolean, a bounded
integer: most of its tokens are forced), each with jump-forward on and off (one engine process each,
benchmarks/structured_worker.py). A sample is a pair on prompts of its own (no prefix cache serves one sample
from another): the batch constrained, then the same prompts unconstrained with each request's max_tokens
set to the tokens its constrained twin produced and ignore_eos (a constrained request cannot ignore EOS: it
ends when its grammar completes), so both arms decode the same tokens in the same batch shapes. tokens/s is
over the tokens actually produced in the decode steps (each request's first token is its prefill's);
max_tokens (512) is far above what the schemas need, and each row reports how many constrained requests it
still cut ("length"). Mask cost comes from the engine's stats, per masked row: the mask thread's time
computing it (mask_ms_per_row) and the sampler's wait for it after the forward (mask_wait_ms_per_row: what
the forward did not hide, the thread's hand-off included, so it can exceed the first on steps shorter than
that hand-off). One untimed pair per row first.

Tokenizer: the bench checkpoint has none, and llguidance needs a real one; the demo model's byte-level BPE
tokenizer.json (8192 tokens, bos 1, eos 2 as TinyLlama's config) goes beside a link to the checkpoint's
weights. The model's 32000 logits rows past the tokenizer's are never allowed under a mask.

    python -m benchmarks.bench_structured [--samples 5] [--batches 1,16] [--threads N]
    NUMASERVE_BENCH_SHORT=1 python -m benchmarks.bench_structured     (a smoke run: small model, few tokens)

Writes benchmarks/results/structured.json and structured.png.
"""

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from benchmarks.bench_decode import CLEAN_ENV
from benchmarks.checkpoints import CACHE, random_checkpoint
from benchmarks.engine_process import EngineProcess
from benchmarks.machine import cpu_name

RESULTS = Path(__file__).parent / "results"
DEMO_TOKENIZER = Path(__file__).parent.parent / "numaserve" / "assets" / "demo" / "base" / "tokenizer.json"
SHORT = os.environ.get("NUMASERVE_BENCH_SHORT") == "1"

SCHEMAS = {
    "free_form": {"type": "object", "additionalProperties": False,
                  "required": ["name", "city", "age", "score", "note"],
                  "properties": {"name": {"type": "string", "maxLength": 16},
                                 "city": {"type": "string", "maxLength": 16},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "score": {"type": "number", "minimum": 0, "maximum": 10},
                                 "note": {"type": "string", "maxLength": 48}}},
    "fixed_keys": {"type": "object", "additionalProperties": False,
                   "required": ["ticket_id", "status", "priority", "assignee", "escalated"],
                   "properties": {"ticket_id": {"type": "integer", "minimum": 0, "maximum": 9999},
                                  "status": {"enum": ["open", "in_progress", "resolved"]},
                                  "priority": {"enum": ["low", "medium", "high"]},
                                  "assignee": {"enum": ["alice.smith", "bob.jones"]},
                                  "escalated": {"type": "boolean"}}},
}
ROWS = [("free_form", True), ("free_form", False), ("fixed_keys", True), ("fixed_keys", False)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()),
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", default="llama-56m" if SHORT else "tinyllama-1.1b",
                        help="random checkpoint shape (benchmarks/checkpoints.py)")
    parser.add_argument("--batches", default="1,16", type=lambda s: [int(b) for b in s.split(",")])
    parser.add_argument("--samples", type=int, default=1 if SHORT else 5, help="timed pairs per row")
    parser.add_argument("--max-tokens", type=int, default=64 if SHORT else 512)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                        help="engine threads (unless given: every core this process may run on)")
    parser.add_argument("--out", default=str(RESULTS / "structured.json"),
                        help="JSON to write (and the PNG beside it)")
    return parser


def with_demo_tokenizer(name: str) -> Path:
    """random_checkpoint(name)'s weights (linked) with the demo model's tokenizer.json beside them."""
    ckpt = random_checkpoint(name)
    directory = CACHE / f"{name}-demo-tokenizer"
    directory.mkdir(exist_ok=True)
    for source in ckpt.iterdir():
        if not (directory / source.name).exists():
            (directory / source.name).symlink_to(source)
    shutil.copy(DEMO_TOKENIZER, directory / "tokenizer.json")
    return directory


def prompts_of(sample: int, batch: int) -> list[str]:
    return [f"Sample {sample}, record {i} of the support desk export, written as one JSON object:"
            for i in range(batch)]


def bench_row(engine: EngineProcess, tokenizer, schema: dict, batch: int, args) -> dict:
    """The row's pairs (an untimed one first) -> medians and the constrained / unconstrained ratio."""
    pairs = []
    for sample in range(args.samples + 1):
        prompts = [tokenizer.encode(p).ids for p in prompts_of(time.monotonic_ns() + sample, batch)]
        pairs.append(engine.call("pair", prompts=prompts, schema=schema, max_tokens=args.max_tokens))
    pairs = pairs[1:]
    constrained = statistics.median(p["decode_tokens"] / p["constrained_s"] for p in pairs)
    free = statistics.median(p["decode_tokens"] / p["unconstrained_s"] for p in pairs)
    rows = sum(p["num_masked_rows"] for p in pairs)
    mask_s, wait_s = sum(p["mask_seconds"] for p in pairs), sum(p["mask_wait_seconds"] for p in pairs)
    return {"constrained_tok_s": constrained, "unconstrained_tok_s": free, "ratio": constrained / free,
            "ratios": [p["unconstrained_s"] / p["constrained_s"] for p in pairs],
            "mean_output_tokens": statistics.mean(n for p in pairs for n in p["output_tokens"]),
            "num_length_finishes": sum(p["num_length_finishes"] for p in pairs),
            "forced_share": sum(p["num_forced_tokens"] for p in pairs) / max(
                1, sum(sum(p["output_tokens"]) for p in pairs)),
            "mask_ms_per_row": 1e3 * mask_s / max(rows, 1),
            "mask_wait_ms_per_row": 1e3 * wait_s / max(rows, 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"b{r['batch']} {r['schema']}\njump {'on' if r['jump_forward'] else 'off'}" for r in rows]
    ax.bar(range(len(rows)), [r["ratio"] for r in rows],
           color=["tab:green" if r["jump_forward"] else "tab:blue" for r in rows])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.95, color="grey", lw=0.8, ls="--")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("constrained / unconstrained tokens/s")
    ax.set_title("JSON-constrained decode speed relative to unconstrained (median of pairs)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    from tokenizers import Tokenizer

    args = build_parser().parse_args()
    model_dir = with_demo_tokenizer(args.model)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    argv = [str(model_dir), "--weight-dtype", "q8_0", "--activation-dtype", "int8", "--threads",
            str(args.threads), "--max-num-seqs", str(max(args.batches))]
    meta = {"model": args.model, "weight_dtype": "q8_0", "activation_dtype": "int8", "threads": args.threads,
            "samples": args.samples, "max_tokens": args.max_tokens, "cpu": cpu_name(),
            "date": time.strftime("%Y-%m-%d %H:%M"), "short_run": SHORT, "tokenizer": "demo model's BPE",
            "schemas": SCHEMAS}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    rows = []
    for jump in (True, False):
        engine = EngineProcess(f"jump_forward {jump}", "benchmarks.structured_worker",
                               argv + ([] if jump else ["--no-jump-forward"]), CLEAN_ENV)
        for batch in args.batches:
            for schema, row_jump in ROWS:
                if row_jump == jump:
                    row = {"batch": batch, "schema": schema, "jump_forward": jump,
                           **bench_row(engine, tokenizer, SCHEMAS[schema], batch, args)}
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "ratios"}), flush=True)
                    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
        engine.close()
    rows.sort(key=lambda r: (r["batch"], r["schema"], not r["jump_forward"]))
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    plot(rows, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
