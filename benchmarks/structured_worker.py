"""numaserve's side of bench_structured: one engine (jump-forward on or off), loaded once, timing a pair of
batches on command (benchmarks/engine_process.py): the prompts constrained to a JSON Schema, then the same
prompts unconstrained with each request's max_tokens set to the tokens its constrained twin produced
(ignore_eos), so both arms decode the same number of tokens in the same batch shapes.

    python -m benchmarks.structured_worker MODEL_DIR --weight-dtype q8_0 --activation-dtype int8 --threads 2
                                           [--no-jump-forward]
"""

import time

import numaserve as ns
from benchmarks.engine_process import serve
from benchmarks.numaserve_worker import decode_seconds, engine_parser

MASK_STATS = ("num_masked_rows", "mask_seconds", "mask_wait_seconds", "num_forced_tokens")


class StructuredBench:
    def __init__(self, args):
        self.llm = ns.LLM(args.model_dir, weight_dtype=args.weight_dtype,
                          activation_dtype=args.activation_dtype, max_num_seqs=args.max_num_seqs,
                          num_threads=args.threads, jump_forward=args.jump_forward)
        self.engine = self.llm.engine

    def run(self, prompts: list[list[int]], params: list[ns.SamplingParams]) -> tuple[float, list]:
        """Seconds of the decode steps (every prompt in: the first tokens are the prefill's) and the
        requests."""
        tag = time.monotonic_ns()
        reqs = [self.engine.add_request(f"bench-{tag}-{i}", prompt, sp)
                for i, (prompt, sp) in enumerate(zip(prompts, params))]
        return decode_seconds(self.engine, reqs), reqs

    def pair(self, prompts: list[list[int]], schema: dict, max_tokens: int) -> dict:
        """The constrained batch, then its unconstrained twin: decode seconds, decode tokens (output tokens
        but each request's first) and the constrained run's mask stats."""
        before = self.engine.stats()
        constraint = ns.StructuredOutputs(json=schema)
        seconds, reqs = self.run(prompts, [ns.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                             structured_outputs=constraint) for _ in prompts])
        after = self.engine.stats()
        lengths = [len(r.output_token_ids) for r in reqs]
        free_seconds, free_reqs = self.run(
            prompts, [ns.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in lengths])
        assert [len(r.output_token_ids) for r in free_reqs] == lengths
        return {"constrained_s": seconds, "unconstrained_s": free_seconds,
                "decode_tokens": sum(lengths) - len(lengths), "output_tokens": lengths,
                "num_length_finishes": sum(r.finish_reason == "length" for r in reqs),
                **{k: after[k] - before[k] for k in MASK_STATS}}


def main() -> None:
    parser = engine_parser()
    parser.add_argument("--no-jump-forward", dest="jump_forward", action="store_false")
    bench = StructuredBench(parser.parse_args())
    bench.pair([[5] * 16] * 2, {"type": "object", "required": ["a"], "additionalProperties": False,
                                "properties": {"a": {"type": "boolean"}}}, 16)  # warm-up: numba compiles
    serve({"pair": bench.pair})


if __name__ == "__main__":
    main()
