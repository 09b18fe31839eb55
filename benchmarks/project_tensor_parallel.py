"""python -m benchmarks.project_tensor_parallel: what tensor parallelism would give on a 2-socket box, from
the simulator's models (numaserve/simulate): one socket's step cost (the `two_socket_32c` preset: this VM's
fitted TinyLlama q8_0 step, compute x16 and bandwidth x5 for a 32-core socket with 8 DDR5 channels), the
all-reduce cost fitted to bench_all_reduce's medians, and the models below scaled from TinyLlama's step
(the weights' stream and the rows' products by the parameters, the fixed per-step cost by the layers, the
attention by the KV width).

For each model: batch-1 decode tokens/s of one node (tensor_parallel_size 1) against one TP=2 group (each
rank on a socket, streaming half the weights from its own memory), and steady decode at c concurrent streams
of two data-parallel replicas (c / 2 streams each) against one TP=2 group (all c): the concurrency above which
the replicas give more tokens/s. And the largest q8_0 model each serves on NODE_GIB per socket. A projection,
not a measurement: its assumptions are in the JSON.

Writes benchmarks/results/tensor_parallel_projection.json and .png."""

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from benchmarks.machine import cpu_name
from numaserve.simulate.step_cost import PRESETS, StepCostModel, StepShape
from numaserve.simulate.tensor_parallel import ModelDims, TensorParallelStepCost, fit_all_reduce

RESULTS = Path(__file__).parent / "results"
NODE_GIB = 48.0  # memory a socket: the 2 x 48 GB box
CONTEXT = 512  # tokens each decoding stream attends to
KV_RESERVE_GIB = 4.0  # a node's memory kept for the KV pool and the process when sizing the largest model
Q8_0_BYTES = 34 / 32  # bytes a weight


@dataclass(frozen=True)
class Shape:
    name: str
    params: float  # weights read per token
    num_layers: int
    hidden: int
    vocab: int
    kv_width: int  # KV heads x head_dim


TINYLLAMA = Shape("TinyLlama-1.1B", 1.10e9, 22, 2048, 32000, 4 * 64)  # the fitted step's model
SHAPES = [TINYLLAMA, Shape("Llama-3-8B", 8.03e9, 32, 4096, 128256, 8 * 128),
          Shape("Llama-3-70B", 70.6e9, 80, 8192, 128256, 8 * 128)]


def scaled(node: StepCostModel, s: Shape) -> StepCostModel:
    """TinyLlama's step cost carried to shape s (see the module docstring)."""
    t = TINYLLAMA
    attention = (s.num_layers * s.kv_width) / (t.num_layers * t.kv_width)
    return replace(node, fixed_s=node.fixed_s * s.num_layers / t.num_layers,
                   weights_s=node.weights_s * s.params / t.params, row_s=node.row_s * s.params / t.params,
                   context_token_s=node.context_token_s * attention,
                   prefill_pair_s=node.prefill_pair_s * attention,
                   source=f"{node.source}, scaled to {s.name}")


def step_floor_s(samples: int = 5) -> float:
    """This VM's decode step of tinyllama-skinny (TinyLlama's 22 layers and vocabulary at width 256) at batch
    1, q8_0 weights, int8 activations, two threads: the Python, dispatch and sampling a step costs whatever
    the memory and cores. Median over samples of (65 tokens - 1 token) / 64, unique prompts."""
    import numaserve as ns
    from benchmarks.checkpoints import random_checkpoint

    llm = ns.LLM(random_checkpoint("tinyllama-skinny"), weight_dtype="q8_0", activation_dtype="int8",
                 num_threads=2, enable_prefix_caching=False)
    rng = np.random.default_rng(0)

    def run(max_tokens: int) -> float:
        prompt = rng.integers(3, 32000, 16).tolist()
        start = time.perf_counter()
        llm.generate([prompt], ns.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
        return time.perf_counter() - start

    run(65)  # compiles or loads the kernels
    per_step = [(run(65) - run(1)) / 64 for _ in range(samples)]
    llm.close()
    return statistics.median(per_step)


def decode(streams: int) -> StepShape:
    return StepShape(streams, 0, 0, streams * CONTEXT, 0)


def tokens_per_s(cost, streams: int) -> float:
    return streams / cost.seconds(decode(streams)) if streams else 0.0


def project(s: Shape, node: StepCostModel, all_reduce) -> dict:
    one = scaled(node, s)
    group = TensorParallelStepCost(one, 2, all_reduce, ModelDims(s.num_layers, s.hidden, s.vocab))
    concurrency = list(range(1, 65))
    tp = [tokens_per_s(group, c) for c in concurrency]
    dp = [tokens_per_s(one, c // 2) + tokens_per_s(one, c - c // 2) for c in concurrency]
    crossover = next((c for c, a, b in zip(concurrency, dp, tp) if a > b), None)
    b1 = decode(1)
    weights_gib = s.params * Q8_0_BYTES / 2**30
    return {
        "params": s.params, "num_layers": s.num_layers, "q8_0_weights_gib": round(weights_gib, 1),
        "batch_1": {"one_node_tok_s": tokens_per_s(one, 1), "tp2_tok_s": tokens_per_s(group, 1),
                    "speedup": tokens_per_s(group, 1) / tokens_per_s(one, 1),
                    "step_ms": {"one_node": one.seconds(b1) * 1e3, "tp2": group.seconds(b1) * 1e3,
                                "tp2_collectives": group.collectives_s(b1) * 1e3,
                                "fixed": one.fixed_s * 1e3}},
        "fits": {"one_node": weights_gib <= NODE_GIB - KV_RESERVE_GIB,
                 "tp2": weights_gib / 2 <= NODE_GIB - KV_RESERVE_GIB},
        "dp_beats_tp2_above_streams": crossover,
        "concurrency": concurrency, "tp2_tok_s": tp, "two_replicas_tok_s": dp,
    }


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = results["models"]
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4))
    for ax, (name, r) in zip(axes, shapes.items()):
        ax.plot(r["concurrency"], r["tp2_tok_s"], label="one TP=2 group (2 sockets)")
        replicas = "two replicas (a socket each)" + ("" if r["fits"]["one_node"] else ": would not fit")
        ax.plot(r["concurrency"], r["two_replicas_tok_s"], label=replicas)
        if r["dp_beats_tp2_above_streams"] is not None:
            ax.axvline(r["dp_beats_tp2_above_streams"], color="grey", linestyle=":")
        ax.set_title(f"{name} q8_0: batch 1 x{r['batch_1']['speedup']:.2f}")
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("decode tokens/s (projected)")
        ax.legend(fontsize=8)
    fig.suptitle("Projected 2 x 32-core box: tensor parallel against data parallel")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.project_tensor_parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=RESULTS / "tensor_parallel_projection.json")
    args = p.parse_args()
    fitted = PRESETS["two_socket_32c"]()
    floor_s = step_floor_s()
    # the fitted fixed cost is not well identified by this VM's steps (the smooth max trades it against the
    # weights' stream); the measured floor is what a step costs without bandwidth or compute
    node = replace(fitted, fixed_s=floor_s, source=f"{fitted.source}, fixed_s the measured step floor")
    all_reduce = fit_all_reduce()
    results = {
        "command": "python -m benchmarks.project_tensor_parallel",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": cpu_name(),
        "assumed": {"socket_step_cost": asdict(node), "fitted_fixed_s": fitted.fixed_s,
                    "measured_step_floor_s": floor_s, "all_reduce": asdict(all_reduce),
                    "all_reduce_note": "measured between two processes on one socket of this VM; a "
                                       "cross-socket one is slower (DeepSpeed's: 12 us at 10 KB)",
                    "node_gib": NODE_GIB, "kv_reserve_gib": KV_RESERVE_GIB, "context_tokens": CONTEXT},
        "models": {s.name: project(s, node, all_reduce) for s in SHAPES},
        # the same with the fitted fixed cost: how much the answer leans on it
        "with_fitted_fixed_s": {s.name: {k: v for k, v in project(s, fitted, all_reduce).items()
                                         if k in ("batch_1", "dp_beats_tp2_above_streams")} for s in SHAPES},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.out.with_suffix(".png"))
    print(f"step floor measured {floor_s * 1e3:.2f} ms (fitted fixed_s {fitted.fixed_s * 1e3:.1f} ms)")
    for name, r in results["models"].items():
        b = r["batch_1"]
        ms = b["step_ms"]
        print(f"{name}: batch 1 {b['one_node_tok_s']:.1f} -> {b['tp2_tok_s']:.1f} tok/s "
              f"(x{b['speedup']:.2f}; step {ms['one_node']:.1f} -> {ms['tp2']:.1f} ms, collectives "
              f"{ms['tp2_collectives']:.2f} ms, fixed {ms['fixed']:.1f} ms); two replicas beat TP=2 above "
              f"{r['dp_beats_tp2_above_streams']} streams; fits one node "
              f"{r['fits']['one_node']}, TP=2 {r['fits']['tp2']}")


if __name__ == "__main__":
    main()
