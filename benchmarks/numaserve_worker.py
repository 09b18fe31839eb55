"""numaserve's side of `numaserve bench`: one engine (weight dtype x activation dtype), loaded once, timed on
command (benchmarks/engine_process.py). `--torch-first` imports torch before numaserve, as a notebook
using transformers would.

    python -m benchmarks.numaserve_worker MODEL_DIR --weight-dtype q8_0 --activation-dtype int8 --threads 2
                                          [--kv-dtype int8 --max-model-len 4200 --kv-cache-bytes N]
"""

import argparse
import sys
import time

if "--torch-first" in sys.argv:
    import torch  # noqa: F401  (before numaserve: the point of that row)

import numba
import numpy as np
import psutil

import numaserve as ns
from benchmarks.engine_process import serve
from memory.weights import ModelWeights
from models.gguf.writer import convert_to_gguf, export_gguf


class NumaserveBench:
    def __init__(self, args):
        self.args = args
        rss_before = psutil.Process().memory_info().rss
        self.llm = ns.LLM(args.model_dir, weight_dtype=args.weight_dtype,
                          activation_dtype=args.activation_dtype, kv_dtype=args.kv_dtype,
                          max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                          max_model_len=args.max_model_len, kv_cache_bytes=args.kv_cache_bytes,
                          num_threads=args.threads,
                          tensor_parallel_size=getattr(args, "tensor_parallel_size", 1))
        self.rss_weights = psutil.Process().memory_info().rss - rss_before
        self.engine = self.llm.engine

    def info(self) -> dict:
        model = self.engine.model
        num_params = int(sum(np.prod(m.shape) for m in _matrices(model.weights)))
        decisions = self.llm.diagnostics()
        spec = self.engine.spec
        return {"weight_bytes": model.weight_bytes, "num_params": num_params,
                "matmul_params": matmul_params(model.weights),
                "active_params": spec.num_params, "active_bytes": _active_bytes(model.weights),
                "kv_bytes_per_position": self.engine.kv_cache.bytes_per_token,  # K and V, scales included
                # a decode step reads only T embedding rows
                "read_bytes": model.weight_bytes - model.weights.embed.nbytes,
                "rss_delta_bytes": self.rss_weights, "threading_layer": numba.threading_layer(),
                "threading": [d["choice"] for d in decisions if d["topic"] == "threading"],
                "activation_dtypes": sorted({d["choice"] for d in decisions
                                             if d["topic"] == "activation_dtype"}),
                "torch_imported_first": "--torch-first" in sys.argv}

    def tensor_parallel(self) -> dict:
        """The engine's tensor-parallel figures (stats()["tensor_parallel"]: the collectives' seconds)."""
        return self.llm.stats()["tensor_parallel"]

    def export_gguf(self, path: str) -> str:
        if self.args.activation_dtype == "float32":  # the loaded weights are the format's own blocks
            export_gguf(self.engine.model.spec, self.engine.model.weights, self.llm.tokenizer, path)
        else:
            convert_to_gguf(self.args.model_dir, path, self.args.weight_dtype)
        return path

    def prefill(self, prompt: list[int]) -> float:
        return self.prefill_batch([prompt])

    def prefill_batch(self, prompts: list[list[int]]) -> float:
        """Seconds to prefill every prompt (together, as the scheduler batches them) to its first token."""
        salt = str(time.monotonic_ns())  # a fresh cache salt: every sample computes the whole prompts
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            self.engine.add_request(f"prefill-{salt}-{i}", prompt,
                                    ns.SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)
        while self.engine.has_unfinished():
            self.engine.step()
        return time.perf_counter() - start

    def decode(self, prompts: list[list[int]], num_steps: int) -> float:
        """Greedy decode of every prompt at once; -> seconds of the decode-only steps."""
        params = ns.SamplingParams(max_tokens=num_steps + 1, temperature=0, ignore_eos=True)
        reqs = [self.engine.add_request(f"bench-{i}-{time.monotonic_ns()}", p, params)
                for i, p in enumerate(prompts)]
        return decode_seconds(self.engine, reqs)

    def open_decode(self, prompts: list[list[int]]) -> float:
        """Prefill every prompt (untimed by the caller) and keep the requests decoding: later
        `decode_more` calls time steps over this context. Ends the context opened before. -> seconds."""
        self.close_decode()
        params = ns.SamplingParams(max_tokens=1 << 30, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        self._open = [self.engine.add_request(f"open-{i}-{time.monotonic_ns()}", p, params)
                      for i, p in enumerate(prompts)]
        prefill_all(self.engine, self._open)
        return time.perf_counter() - start

    def decode_more(self, num_steps: int) -> float:
        """Seconds of num_steps decode steps of the open context (one token a request a step)."""
        start = time.perf_counter()
        for _ in range(num_steps):
            self.engine.step()
        return time.perf_counter() - start

    def close_decode(self) -> None:
        for r in getattr(self, "_open", []):
            self.engine.abort(r.request_id)
        self._open = []
        while self.engine.has_unfinished():
            self.engine.step()


def prefill_all(engine, reqs) -> None:
    """Steps until every request's prompt is in (the steps that follow decode alone). A finished request
    counts as in (its blocks went back, and its computed count with them): with fewer sequences than
    requests, the first finish before the last are admitted."""
    while any(not r.finished and r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()


def decode_seconds(engine, reqs) -> float:
    """prefill_all, then times the steps to the end: seconds of decode alone."""
    prefill_all(engine, reqs)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def _active_bytes(weights: ModelWeights) -> float:
    """The matrix bytes a decode token reads as served: every projection, a MoE layer's router and its
    top_k / num_experts share of the experts, the LM head."""
    total = weights.lm_head.nbytes
    for layer in weights.layers:
        experts = layer.experts
        total += sum(layer.projection(k).nbytes for k in layer.projections[:2])
        if experts is None:
            total += layer.gate_up.nbytes + layer.down.nbytes
        else:
            share = experts.top_k / experts.num_experts
            total += experts.router.nbytes + share * (experts.gate_up.nbytes + experts.down.nbytes)
    return total


def matmul_params(weights: ModelWeights) -> int:
    """The weights a token multiplies in a dense model: every matrix but the embedding table (a lookup) unless
    it is the LM head too; a MoE token multiplies only its experts' (active_params)."""
    num_params = int(sum(np.prod(m.shape) for m in _matrices(weights)))
    embed = int(np.prod(weights.embed.shape))
    return num_params - (0 if weights.lm_head is weights.embed else embed)


def _matrices(weights: ModelWeights):
    yield weights.embed
    if weights.lm_head is not weights.embed:
        yield weights.lm_head
    for layer in weights.layers:
        yield from (layer.projection(k) for k in layer.projections)


def engine_parser() -> argparse.ArgumentParser:
    """The options every numaserve worker's engine takes (this one's and structured_worker's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("--weight-dtype", required=True)
    parser.add_argument("--activation-dtype", default="float32")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    return parser


def main() -> None:
    parser = engine_parser()
    parser.add_argument("--kv-dtype", default="bfloat16")
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--torch-first", action="store_true")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks (--threads each)")
    bench = NumaserveBench(parser.parse_args())
    bench.decode([[5] * 16] * 2, 2)  # warm-up: numba compiles (or loads) every kernel signature once
    serve({"info": bench.info, "tensor_parallel": bench.tensor_parallel, "export_gguf": bench.export_gguf,
           "prefill": bench.prefill, "prefill_batch": bench.prefill_batch, "decode": bench.decode,
           "open_decode": bench.open_decode, "decode_more": bench.decode_more,
           "close_decode": bench.close_decode})


if __name__ == "__main__":
    main()
