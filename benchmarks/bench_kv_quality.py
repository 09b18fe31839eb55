"""KV dtypes' quality on the shipped demo model against bfloat16 KV: held-out perplexity over its full
1024-token context (evenly spaced windows of the model card's held-out stream, numaserve/demo_eval.py)
and greedy agreement, 32 tokens after each of 16 held-out prompts of 128 tokens. Deterministic: the same
figures on any machine with the same kernels.

    python -m benchmarks.bench_kv_quality [--windows 16] [--kv-dtypes int8,fp8_e4m3,...]

Writes benchmarks/results/kv_quality.json.
"""

import argparse
import json
from pathlib import Path

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
    perplexity,
)

RESULTS = Path(__file__).parent / "results"
BASE = DEMO_DIR / "base"
REFERENCE = "bfloat16"
CONTEXT = 1024  # the demo model's max_position_embeddings


def measure(kv_dtype: str, windows: list, prompts: list[list[int]]) -> tuple[float, list[list[int]]]:
    """(held-out perplexity, greedy continuations) with kv_dtype KV."""
    llm = ns.LLM(BASE, kv_dtype=kv_dtype, max_num_batched_tokens=CONTEXT)
    return perplexity(llm.score, windows), [c.token_ids for c in llm.generate(prompts, GREEDY)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=16, help="1024-token windows scored")
    reduced = [d for d in KV_FORMATS if d not in ("float32", REFERENCE)]
    parser.add_argument("--kv-dtypes", default=",".join(reduced), help="KV dtypes against bfloat16 KV")
    parser.add_argument("--out", default=str(RESULTS / "kv_quality.json"), help="JSON to write")
    args = parser.parse_args(argv)
    tokenizer = Tokenizer.from_dir(BASE)
    windows = token_windows(heldout_stream(tokenizer), CONTEXT, args.windows)
    prompts = greedy_prompts(tokenizer)
    base_ppl, base_tokens = measure(REFERENCE, windows, prompts)
    rows = {}
    for kv_dtype in args.kv_dtypes.split(","):
        ppl, tokens = measure(kv_dtype, windows, prompts)
        rows[kv_dtype] = {"perplexity": ppl, "vs_bf16": ppl / base_ppl - 1,
                          **greedy_agreement(tokens, base_tokens)}
        row = rows[kv_dtype]
        print(f"{kv_dtype:<18} perplexity {ppl:.4f} ({row['vs_bf16']:+.3%} against bfloat16 KV), "
              f"{row['identical_continuations']}/{NUM_PROMPTS} greedy continuations identical, "
              f"prefix agreement {row['prefix_agreement']:.3f}", flush=True)
    result = {"model": "numaserve demo base", "windows": len(windows), "window_tokens": CONTEXT,
              "prompts": NUM_PROMPTS, "prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS,
              "bf16_perplexity": base_ppl, "kv_dtypes": rows}
    out = Path(args.out)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
