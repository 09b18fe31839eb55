"""`numaserve demo`: the local deployment with the shipped demo model and its two LoRA adapters.

Starts Ray and one worker per NUMA node (auto topology), streams a completion of the same prompts from
the base model and from each adapter, prints a summary, and shuts everything down.
"""

import tempfile
import time
from pathlib import Path

from cluster_configs.errors import CheckpointError
from cluster_configs.sampling_params import SamplingParams

DEMO_DIR = Path(__file__).parent / "assets" / "demo"
ADAPTERS = ("tests", "library")  # trained on the standard library's test modules / its other modules
PROMPTS = ("def test_", "class Stack:\n    def __init__(self")
# seeded sampling, the same seed for every adapter: greedy decoding of a 7M-parameter model loops on a
# phrase ("from_from_from"), while sampled text shows what each adapter learned
SAMPLING = {"temperature": 0.6, "top_p": 0.9, "seed": 0}


def run_demo(max_tokens: int = 48) -> dict:
    import ray

    from actors.deploy import serve

    model_dir = DEMO_DIR / "base"
    if not (model_dir / "config.json").exists():
        raise CheckpointError(f"{model_dir}: the demo model is missing; reinstall numaserve or rebuild it with "
                              "python scripts/train_demo.py")
    from cluster_configs.cluster_config import ClusterConfig

    start = time.perf_counter()
    # a registry of its own per run: a persistent one would tie the names to the first checkout that ran it
    registry_dir = tempfile.TemporaryDirectory(prefix="numaserve-demo-")
    registry = Path(registry_dir.name) / "adapters.json"
    client = serve(ClusterConfig(adapter_registry=str(registry)), model=model_dir, name="numaserve-demo")
    try:
        for name in ADAPTERS:
            client.register_adapter(name, DEMO_DIR / "adapters" / name)
        workers = client.stats()["workers"]
        print(f"deployment up in {time.perf_counter() - start:.1f} s: " + ", ".join(
            f"{w} on cores {s['info']['cpu_ids']} ({s['info']['num_threads']} threads)" for w, s in workers.items()))
        num_tokens, seconds = 0, 0.0
        for prompt in PROMPTS:
            for adapter in (None, *ADAPTERS):
                params = SamplingParams(max_tokens=max_tokens, **SAMPLING)
                print(f"\n--- {adapter or 'base'} ---\n{prompt}", end="", flush=True)
                t = time.perf_counter()
                for chunk in client.stream(prompt, params, adapter=adapter):
                    print(chunk.text, end="", flush=True)
                    num_tokens += len(chunk.token_ids)
                seconds += time.perf_counter() - t
        stats = client.stats()
        engines = [w for w in stats["workers"].values() if "kv_usage" in w]
        summary = {"tokens": num_tokens, "tokens_per_s": num_tokens / seconds,
                   "prefix_hit_rate": max(w["prefix_hit_rate"] for w in engines),
                   "kv_bytes_per_token": engines[0]["kv_bytes_per_token"], "routed": stats["routed"]}
        print(f"\n\n--- summary ---\n{num_tokens} tokens streamed at {summary['tokens_per_s']:.1f} tokens/s "
              f"(one stream at a time), routing decisions {summary['routed']}, prefix-cache hit rate "
              f"{summary['prefix_hit_rate']:.0%}, {summary['kv_bytes_per_token']} KV bytes per token; "
              "speculative decoding with the shipped draft model arrives with its own issue")
        return summary
    finally:
        client.shutdown()
        ray.shutdown()
        registry_dir.cleanup()
