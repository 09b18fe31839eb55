"""numaserve with LoRA adapters, for benchmarks/bench_lora.py: one engine per weight dtype, loaded once with
its adapters, timed on command (benchmarks/engine_process.py).

    python -m benchmarks.lora_worker MODEL_DIR ADAPTER_DIR... --weight-dtype q8_0 --threads 2 --max-loras 16
"""

import argparse
import time

import numaserve as ns
from benchmarks.engine_process import serve
from benchmarks.numaserve_worker import decode_seconds


class LoraBench:
    def __init__(self, args):
        self.llm = ns.LLM(args.model_dir, weight_dtype=args.weight_dtype, kv_dtype="bfloat16",
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=512,
                          num_threads=args.threads,
                          max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        self.names = []
        for i, path in enumerate(args.adapter_dirs):
            self.names.append(f"lora{i}")
            self.llm.register_adapter(self.names[-1], path)
        self.engine = self.llm.engine

    def decode(self, prompts: list[list[int]], num_adapters: int, num_steps: int) -> float:
        """Greedy decode of every prompt at once, request i with adapter i % num_adapters (0: none);
        -> seconds of the decode-only steps."""
        params = ns.SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
        reqs = [self.engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params,
                                        adapter=self.names[i % num_adapters] if num_adapters else None)
                for i, p in enumerate(prompts)]
        return decode_seconds(self.engine, reqs)

    def mixed_step(self, num_rows: int, merge: str, num_base: int) -> float:
        """Seconds of one step that decodes num_base base requests and prefills num_rows tokens of one
        adapter, with that adapter's rows on the low-rank path (merge "never") or its merged copy
        ("always")."""
        self.engine.runner.lora.mode = merge
        params = ns.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
        stamp = time.monotonic_ns()
        base = [self.engine.add_request(f"base-{i}-{stamp}", [5 + i] * 16, params) for i in range(num_base)]
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in base):
            self.engine.step()
        prompt = [(7 * i) % 30000 + 3 for i in range(num_rows)]
        adapted = self.engine.add_request(f"adapted-{stamp}", prompt, params, adapter=self.names[0],
                                          cache_salt=str(stamp))
        start = time.perf_counter()
        self.engine.step()  # num_base decode rows + the adapter's num_rows prefill rows
        seconds = time.perf_counter() - start
        if adapted.num_computed_tokens != num_rows:
            raise RuntimeError(f"the adapter's {num_rows} rows did not all run in the timed step; raise "
                               "max_num_seqs / max_num_batched_tokens")
        while self.engine.has_unfinished():
            self.engine.step()
        return seconds

    def stats(self) -> dict:
        return {k: v for k, v in self.llm.stats().items()
                if k.startswith(("lora", "adapter", "num_lora", "num_merged"))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("adapter_dirs", nargs="*")
    parser.add_argument("--weight-dtype", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--max-loras", type=int, default=16)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    bench = LoraBench(parser.parse_args())
    for n in (0, 1):  # warm-up: numba compiles (or loads) every kernel signature once
        bench.decode([[5] * 16] * 2, n, 2)
    serve({"decode": bench.decode, "mixed_step": bench.mixed_step, "stats": bench.stats})


if __name__ == "__main__":
    main()
