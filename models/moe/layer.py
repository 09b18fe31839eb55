"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a float32 router picks each token's top-k experts,
each expert is a SiLU-gated MLP, and a token's output is the routing-weighted sum of its experts' outputs.

Only the experts some token of the step was routed to run, each over its own rows: experts packed for the
VNNI kernel all in one compiled call (kernels/moe/fused.py), other formats one linear call per expert on
zero-copy views of the stacked matrices (memory/weights.row_block); the ids moe_forward returns say which
ones ran.
"""

from collections.abc import Callable

import numpy as np

from kernels.linear.chunking import linear_tiles
from kernels.moe.fused import moe_vnni
from kernels.moe.route import gather_rows, group_by_expert, route_tokens, weighted_sum
from kernels.norms import silu_mul
from memory.experts import ExpertWeights
from memory.matrices import Int8Matrix, Matrix, WeightMatrix
from models.linear import linear as linear_f32
from models.moe.buffers import MoeBuffers

Linear = Callable[[np.ndarray, Matrix], np.ndarray]  # (x [T, K] f32, w [N, K]) -> [T, N] f32


def route(logits: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face's router (Qwen3MoeTopKRouter, MixtralTopKRouter): softmax in float32 over all experts,
    the top_k probabilities, divided by their sum if normalize.

    logits: [T, E] f32 -> ids: [T, top_k] int32, weights: [T, top_k] f32, by descending weight. Equal
    probabilities go by ascending expert id. torch.topk leaves the order of equal values unspecified
    (on CPU it is not by id: 8 equal values of 64 came back as 44, 41, 42, 43, 46, 47, 40, 45), so where a
    tie straddles the k-th place the chosen experts may differ from transformers'; with real-valued
    activations exact ties do not arise."""
    T = logits.shape[0]
    ids = np.empty((T, top_k), np.int32)
    weights = np.empty((T, top_k), np.float32)
    route_tokens(np.ascontiguousarray(logits, np.float32), normalize, ids, weights)
    return ids, weights


Observe = Callable[[int, str, np.ndarray], None]  # (expert, "gate_up" | "down", its inputs [n, K])


def moe_forward(x: np.ndarray, experts: ExpertWeights, linear: Linear, buffers: MoeBuffers | None = None,
                observe: Observe | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The MoE MLP over a flat token batch: x [T, hidden] f32 -> (out [T, hidden] f32, ids [T, k] int32,
    the experts each token was routed to: those that ran).

    The router runs in float32 (models.linear.linear's kernel) whatever the caller's linear. Experts packed
    for the VNNI kernel run in one compiled call (kernels/moe/fused.py) in `buffers` (a fresh MoeBuffers when
    None; the results are views into it, valid until its next use); other formats go through `linear`, one
    call per routed expert and projection on its views. A token's output is its slots' outputs summed in
    slot order, each from its own row alone: the same bits in any batch, and on either path. Experts held by
    another rank (expert parallelism) add zero: the ranks' outputs sum to the layer's (the caller's
    all-reduce). observe(expert, "gate_up" | "down", inputs): shown each routed expert's projection inputs
    (the per-expert path then runs)."""
    x = np.ascontiguousarray(x, np.float32)
    if _fused(experts) and observe is None:
        return _experts_fused(x, experts, buffers or MoeBuffers())
    T, hidden = x.shape
    k, I = experts.top_k, experts.intermediate_size
    logits = linear_f32(x, WeightMatrix("float32", experts.router))  # [T, E]
    ids, weights = route(logits, k, experts.normalize)
    offsets = np.empty(experts.num_experts + 1, np.int64)
    slots, position = np.empty(T * k, np.int64), np.empty(T * k, np.int64)
    group_by_expert(ids, offsets, slots, position)
    # each (token, slot)'s expert output, grouped by expert, kept for the slot-order sum: T * k rows (a
    # 512-token chunk, k = 8, hidden 2048: 32 MB); zeros for pairs routed to experts another rank holds
    first, end = experts.held
    y = (np.empty if (first, end) == (0, experts.num_experts) else np.zeros)((T * k, hidden), np.float32)
    for e in np.flatnonzero(np.diff(offsets[first:end + 1])) + first:
        a, b = offsets[e], offsets[e + 1]
        gate_up, down = experts.expert(e)
        xe = np.empty((b - a, hidden), np.float32)
        gather_rows(x, slots[a:b], k, xe)
        act = np.empty((b - a, I), np.float32)
        if observe is not None:
            observe(e, "gate_up", xe)
        silu_mul(linear(xe, gate_up), act)  # [n, 2 * I] -> [n, I]
        if observe is not None:
            observe(e, "down", act)
        y[a:b] = linear(act, down)
    out = np.empty((T, hidden), np.float32)
    weighted_sum(y, weights, position, out)
    return out, ids


class ExpertLog:
    """Where a model's tokens were routed: (token, slot) pairs per expert of each layer since the model was
    built, and the last step's choice (the engine's diagnostics read it)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.counts = np.zeros((num_layers, num_experts), np.int64)  # [L, E]
        self.last: list[np.ndarray | None] = [None] * num_layers  # [T, k] int32 per layer

    def record(self, layer: int, ids: np.ndarray) -> None:
        self.counts[layer] += np.bincount(ids.ravel(), minlength=self.counts.shape[1])
        self.last[layer] = ids.copy()  # ids may be a view into buffers the next layer reuses

    def describe(self, layer: int, top: int = 8) -> str:
        counts = self.counts[layer]
        total = int(counts.sum())
        if not total:
            return "no token routed yet"
        busiest = np.argsort(-counts, kind="stable")[:top]
        used = int(np.count_nonzero(counts))
        last = self.last[layer]
        return (f"{total} (token, expert) routings to {used} of {len(counts)} experts; busiest: "
                + ", ".join(f"{e} ({counts[e] / total:.0%})" for e in busiest if counts[e])
                + f"; last step: {len(np.unique(last))} experts for {last.shape[0]} tokens")


def _fused(experts: ExpertWeights) -> bool:
    """Whether the routed experts run in one compiled call: both matrices packed for the VNNI kernel (what
    int8 activations use where the CPU has it; ExpertWeights checked at construction that each expert's rows
    are whole blocks of 4)."""
    return all(isinstance(w, Int8Matrix) and w.vnni for w in (experts.gate_up, experts.down))


def _experts_fused(x: np.ndarray, experts: ExpertWeights,
                   buffers: MoeBuffers) -> tuple[np.ndarray, np.ndarray]:
    # x: [T, hidden] f32 -> (out [T, hidden], ids [T, k]): views into buffers
    T = x.shape[0]
    gu, down = experts.gate_up, experts.down
    arrays = buffers.arrays(experts, T)
    first, end = experts.held
    moe_vnni(x, experts.router, experts.normalize, experts.top_k, first, end, gu.data, gu.scales,
             gu.activation_scale, _bits(gu), down.data, down.scales, down.activation_scale, _bits(down),
             linear_tiles().x_chunk_bytes, *arrays)
    return arrays.out[:T], arrays.ids[:T]


def _bits(w: Int8Matrix) -> int:
    return 4 if w.dtype == "q4_0" else 8
