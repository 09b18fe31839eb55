"""`numaserve demo`: stream completions from the shipped demo model and print a summary."""

import time
from pathlib import Path

from cluster_configs.errors import CheckpointError
from cluster_configs.sampling_params import SamplingParams

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
PROMPTS = ("def fibonacci(n):\n", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def __init__(self")


def run_demo(max_tokens: int = 48) -> dict:
    from numaserve.llm import LLM

    model_dir = DEMO_DIR / "base"
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir}: the demo model is missing; reinstall numaserve or rebuild it with "
                              "python scripts/train_demo.py")
    start = time.perf_counter()
    llm = LLM(model_dir)
    print(f"loaded {model_dir.name} in {time.perf_counter() - start:.1f} s "
          f"({llm.engine.model.weight_bytes / 2**20:.1f} MiB of {llm.engine.model.weight_dtype} weights)")
    decode_seconds = 0.0
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.7, top_p=0.95, seed=i)
        print(f"\n--- prompt {i + 1} ---\n{prompt}", end="", flush=True)
        start = time.perf_counter()
        for delta in llm.stream(prompt, params):
            print(delta, end="", flush=True)
        decode_seconds += time.perf_counter() - start
    stats = llm.stats()
    num_tokens = stats["num_generated_tokens"]
    stats["tokens_per_s"] = num_tokens / decode_seconds
    print(f"\n\n--- summary ---\n{num_tokens} tokens at {stats['tokens_per_s']:.1f} tokens/s (batch 1, including "
          f"prefill), prefix-cache hit rate {stats['prefix_hit_rate']:.0%}, {stats['num_blocks']} KV blocks of "
          f"{llm.config.block_size} tokens ({stats['kv_bytes_per_token']} bytes per token)")
    return stats
