"""Sampling cost of one engine step: 32 requests at temperature 0.7, top_p 0.9 on a 32k vocabulary, the
per-request sampler the engine had before speculation ("before": tests/support/reference_sampler.py, the
sampler as of commit 972df84) against the batched sampler of scheduling/sampling/sampler.py ("after"),
alternating sample by sample, next to the TinyLlama-shaped batch-32 decode step time (greedy, so the step is
the forward pass plus bookkeeping). Goal: sampling under 5% of that step.

    python -m benchmarks.bench_sampling                  # about 2 minutes on 2 cores (TinyLlama load + steps)
    python -m benchmarks.bench_sampling --model llama-56m --samples 5   # smoke run, seconds

Writes benchmarks/results/sampling.json and sampling.png and prints one JSON line per point.
"""

import argparse
import inspect
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import numaserve as ns
from benchmarks.checkpoints import random_checkpoint
from cluster_configs.sampling_params import SamplingParams
from tests.support.reference_sampler import apply_penalties, sample

RESULTS = Path(__file__).parent / "results"
NUM_REQUESTS, VOCAB, PROMPT_LEN = 32, 32000, 16
PARAMS = {"temperature": 0.7, "top_p": 0.9}


# ---- the step's requests, and the two samplers over them -------------------------------------------

class BenchRequest:
    """What a sampler reads from a request: its tokens, parameters, and (old sampler) its generator."""

    def __init__(self, i: int, prompt: list[int], output: list[int], params: SamplingParams):
        self.request_id = f"s{i}"
        self.token_ids = prompt + output
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


def step_before(logits: np.ndarray, requests: list[BenchRequest]) -> list[int]:
    """What the engine's _append_token did, request by request."""
    out = []
    for i, r in enumerate(requests):
        x = apply_penalties(logits[i], r.token_ids[:r.num_prompt_tokens], r.output_token_ids, r.params)
        out.append(sample(x, r.params, r.rng))
    return out


def batched_sampler():
    """The new batched sampler as `fn(logits [N, V], requests) -> list[int]`, or None before it lands."""
    from scheduling.sampling import sampler

    fn = getattr(sampler, "sample_batch", None)
    if fn is None:
        return None
    from models.sampling_batch import SamplingBatch

    names = list(inspect.signature(fn).parameters)
    if names[:2] == ["logits", "requests"]:  # before SamplingBatch: the requests themselves
        return lambda logits, requests: [int(t) for t in fn(logits, requests)]
    if names[:2] == ["logits", "batch"]:  # the step builds its SamplingBatch (timed with the sampler)
        return lambda logits, requests: [int(t) for t in fn(logits, SamplingBatch.build(
            [r.params for r in requests], [r.params.seed or 0 for r in requests],
            [r.num_tokens for r in requests], [r.token_ids for r in requests],
            [r.num_prompt_tokens for r in requests]))]
    return None


def synthetic_logits(seed: int) -> np.ndarray:
    """[NUM_REQUESTS, VOCAB] float32 logits, peaked like a trained model's (a few tokens hold most mass)."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((NUM_REQUESTS, VOCAB)) * 2.5).astype(np.float32)


# ---- the decode step it is compared with --------------------------------------------------------------

def decode_step_seconds(llm: ns.LLM, num_steps: int, params: SamplingParams) -> list[float]:
    """Per-step seconds of `num_steps` batch-32 decode steps after a prefill of 32 random prompts."""
    engine = llm.engine
    rng = np.random.default_rng(0)
    params = params.model_copy(update={"max_tokens": num_steps + 2, "ignore_eos": True})
    prompts = [rng.integers(3, VOCAB, PROMPT_LEN).tolist() for _ in range(NUM_REQUESTS)]
    reqs = [engine.add_request(f"step-{i}-{time.monotonic_ns()}", p, params) for i, p in enumerate(prompts)]
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
        engine.step()
    times = []
    while engine.has_unfinished():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[:num_steps]


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    step_ms = result["decode_step_ms"]
    names = [n for n in ("before", "after") if n in result["sampling_ms"]]
    values = [result["sampling_ms"][n] for n in names]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    bars = ax.barh([f"sampling, {n}" for n in names] + ["decode step (greedy)"], values + [step_ms],
                   color=["tab:red", "tab:green"][:len(names)] + ["tab:gray"])
    for bar, v in zip(bars, values + [step_ms]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {v:.1f} ms ({v / step_ms:.1%})",
                va="center")
    ax.axvline(0.05 * step_ms, color="k", ls=":", label="5% of the decode step")
    ax.set_xlabel(f"ms per step, {NUM_REQUESTS} requests, T={PARAMS['temperature']}, top_p={PARAMS['top_p']}")
    meta = result["meta"]
    ax.set_title(f"Sampling cost vs {meta['model']} ({meta['weight_dtype']}) batch-{NUM_REQUESTS} "
                 "decode step")
    ax.set_xlim(0, max(values + [step_ms]) * 1.5)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tinyllama-1.1b")
    parser.add_argument("--weight-dtype", default="bfloat16")
    parser.add_argument("--samples", type=int, default=21, help="sampling samples per sampler (alternating)")
    parser.add_argument("--steps", type=int, default=5, help="timed batch-32 decode steps")
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    requests = [BenchRequest(i, prompt=rng.integers(3, VOCAB, PROMPT_LEN).tolist(),
                             output=rng.integers(3, VOCAB, 8).tolist(),
                             params=SamplingParams(seed=i, **PARAMS))
                for i in range(NUM_REQUESTS)]
    samplers = {"before": step_before}
    after = batched_sampler()
    if after is not None:
        samplers["after"] = after
    else:
        print("# scheduling.sampling.sampler has no batched sampler yet: timing the per-request one only")
    logits = synthetic_logits(0)
    for fn in samplers.values():
        fn(logits, requests)  # warm-up (numba compiles)
    times = {name: [] for name in samplers}
    names = list(samplers)
    for s in range(args.samples):
        logits = synthetic_logits(s)
        for name in (names if s % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            samplers[name](logits, requests)
            times[name].append(time.perf_counter() - start)
    sampling_ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
    for name, ms in sampling_ms.items():
        samples_ms = [1e3 * t for t in times[name]]
        print(json.dumps({"point": f"sampling_{name}", "ms": ms, "samples_ms": samples_ms}))

    llm = ns.LLM(random_checkpoint(args.model), weight_dtype=args.weight_dtype, max_num_seqs=NUM_REQUESTS,
                 max_num_batched_tokens=NUM_REQUESTS * PROMPT_LEN)
    decode_step_seconds(llm, 1, SamplingParams(temperature=0))  # warm-up: numba compiles every signature once
    greedy = decode_step_seconds(llm, args.steps, SamplingParams(temperature=0))
    sampled = decode_step_seconds(llm, args.steps, SamplingParams(seed=0, **PARAMS))
    step_ms, sampled_step_ms = 1e3 * statistics.median(greedy), 1e3 * statistics.median(sampled)
    print(json.dumps({"point": "decode_step_greedy", "ms": step_ms, "samples_ms": [1e3 * t for t in greedy]}))
    print(json.dumps({"point": "decode_step_sampled", "ms": sampled_step_ms,
                      "samples_ms": [1e3 * t for t in sampled]}))
    fractions = {name: ms / step_ms for name, ms in sampling_ms.items()}
    best = sampling_ms.get("after", sampling_ms["before"])
    result = {
        "meta": {"model": args.model, "weight_dtype": args.weight_dtype, "num_requests": NUM_REQUESTS,
                 "vocab": VOCAB, "params": PARAMS, "samples": args.samples, "steps": args.steps,
                 "after_sampler": "scheduling.sampling.sampler.sample_batch" if "after" in samplers else None,
                 "threads": llm.engine.config.num_threads, "cpu": platform.processor() or platform.machine(),
                 "date": time.strftime("%Y-%m-%d %H:%M")},
        "sampling_ms": sampling_ms,
        "sampling_samples_ms": {n: [1e3 * t for t in v] for n, v in times.items()},
        "decode_step_ms": step_ms, "decode_step_sampled_ms": sampled_step_ms,
        "fraction_of_decode_step": fractions,
        "speedup": sampling_ms["before"] / sampling_ms["after"] if "after" in sampling_ms else None,
        "goal_under_5_percent": best / step_ms < 0.05,
    }
    print(json.dumps({"point": "summary", "fraction_of_decode_step": fractions, "speedup": result["speedup"],
                      "goal_under_5_percent": result["goal_under_5_percent"]}))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sampling.json").write_text(json.dumps(result, indent=2))
    plot(result, RESULTS / "sampling.png")


if __name__ == "__main__":
    main()
