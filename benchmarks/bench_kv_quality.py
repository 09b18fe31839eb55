"""KV dtypes' quality on the shipped demo model against bfloat16 KV: held-out perplexity and the mean KL
divergence of the next-token distribution from bfloat16 KV's, over evenly spaced windows of the model card's
held-out stream (numaserve/demo_eval.py) at each context length, with the paired standard error of the
perplexity change across windows; and greedy agreement, 32 tokens after each of 16 held-out prompts of 128
tokens. Deterministic: the same figures on any machine with the same kernels.

The demo model was trained on 256-token windows; its max_position_embeddings is 1024, and contexts beyond it
(4096) are served with max_model_len raised (plain RoPE, no scaling): the model extrapolates there, so its
perplexity is higher, but every dtype is compared on the same windows against the same bfloat16 KV run.

    python -m benchmarks.bench_kv_quality [--windows 64] [--contexts 1024,4096] [--kv-dtypes int8,...]
                                          [--long-kv-dtypes int4,int4_hadamard]

The first context scores every dtype of --kv-dtypes, the longer ones those of --long-kv-dtypes (the 4-bit
forms by default: a 4096-token window costs each engine several seconds here).

Writes benchmarks/results/kv_quality.json and .png.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np

import numaserve as ns
from memory.kv_formats import KV_FORMATS
from models.quantization.calibrate import token_windows
from models.tokenizer import Tokenizer
from numaserve.demo import DEMO_DIR
from numaserve.demo_eval import (
    GREEDY,
    NEW_TOKENS,
    NUM_PROMPTS,
    PROMPT_TOKENS,
    greedy_agreement,
    greedy_prompts,
    heldout_stream,
    window_scores,
)

RESULTS = Path(__file__).parent / "results"
BASE = DEMO_DIR / "base"
REFERENCE = "bfloat16"
CONTEXTS = "1024,4096"  # the demo model's max_position_embeddings, and 4x it


def context_rows(kv_dtypes: list[str], context: int, num_windows: int, stream: np.ndarray) -> dict:
    windows = token_windows(stream, context, num_windows)
    scores = window_scores({d: ns.LLM(BASE, kv_dtype=d, max_model_len=context,
                                      max_num_batched_tokens=context).score
                            for d in [REFERENCE, *kv_dtypes]}, windows)
    base_nll = scores[REFERENCE][0]
    rows = {}
    for dtype in kv_dtypes:
        nll, kl = scores[dtype]
        change = nll - base_nll  # per window
        rows[dtype] = {"perplexity": math.exp(nll.mean()), "vs_bf16": math.exp(change.mean()) - 1,
                       "vs_bf16_standard_error": float(change.std(ddof=1) / math.sqrt(len(change))),
                       "kl_divergence": float(kl.mean())}
        row = rows[dtype]
        print(f"{context:>5} {dtype:<15} perplexity {row['perplexity']:.4f} ({row['vs_bf16']:+.3%} +- "
              f"{row['vs_bf16_standard_error']:.3%} against bfloat16 KV), KL {row['kl_divergence']:.5f}",
              flush=True)
    return {"window_tokens": context, "windows": len(windows), "bf16_perplexity": math.exp(base_nll.mean()),
            "kv_dtypes": rows}


def greedy_rows(kv_dtypes: list[str], tokenizer) -> dict:
    prompts = greedy_prompts(tokenizer)
    tokens = {d: [c.token_ids for c in ns.LLM(BASE, kv_dtype=d).generate(prompts, GREEDY)]
              for d in [REFERENCE, *kv_dtypes]}
    return {d: greedy_agreement(tokens[d], tokens[REFERENCE]) for d in kv_dtypes}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=64, help="windows scored at each context length")
    parser.add_argument("--contexts", default=CONTEXTS, help="window lengths in tokens")
    reduced = [d for d in KV_FORMATS if d not in ("float32", REFERENCE)]
    parser.add_argument("--kv-dtypes", default=",".join(reduced), help="KV dtypes against bfloat16 KV")
    parser.add_argument("--long-kv-dtypes", default="int4,int4_hadamard",
                        help="KV dtypes scored at the contexts after the first")
    parser.add_argument("--out", default=str(RESULTS / "kv_quality.json"), help="JSON to write (and .png)")
    args = parser.parse_args(argv)
    kv_dtypes = args.kv_dtypes.split(",")
    tokenizer = Tokenizer.from_dir(BASE)
    stream = heldout_stream(tokenizer)
    lengths = [int(c) for c in args.contexts.split(",")]
    long_dtypes = [d for d in args.long_kv_dtypes.split(",") if d in kv_dtypes]
    contexts = {str(c): context_rows(kv_dtypes if i == 0 else long_dtypes, c, args.windows, stream)
                for i, c in enumerate(lengths)}
    greedy = greedy_rows(kv_dtypes, tokenizer)
    for dtype, row in greedy.items():
        print(f"{dtype:<15} {row['identical_continuations']}/{NUM_PROMPTS} greedy continuations identical, "
              f"prefix agreement {row['prefix_agreement']:.3f}", flush=True)
    result = {"model": "numaserve demo base", "trained_window_tokens": 256, "prompts": NUM_PROMPTS,
              "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "contexts": contexts,
              "greedy": greedy}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    contexts = result["contexts"]
    dtypes = list(next(iter(contexts.values()))["kv_dtypes"])  # the first context scores every dtype
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(contexts)
    for i, (context, data) in enumerate(contexts.items()):
        scored = [d for d in dtypes if d in data["kv_dtypes"]]
        x = np.array([dtypes.index(d) for d in scored]) + i * width
        rows = [data["kv_dtypes"][d] for d in scored]
        axes[0].bar(x, [100 * r["vs_bf16"] for r in rows], width,
                    yerr=[100 * r["vs_bf16_standard_error"] for r in rows], label=f"{context} tokens")
        axes[1].bar(x, [r["kl_divergence"] for r in rows], width, label=f"{context} tokens")
    for ax, title in zip(axes, ("perplexity vs bfloat16 KV (%), +- 1 standard error",
                                "mean KL divergence from bfloat16 KV (nats)")):
        ax.set_xticks(np.arange(len(dtypes)) + width * (len(contexts) - 1) / 2, dtypes, rotation=30)
        ax.set_title(title, fontsize=10)
        ax.legend()
    fig.suptitle("KV dtypes on the demo model, held-out windows", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
