"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a float32 router picks each token's top-k experts,
each expert is a SiLU-gated MLP, and a token's output is the routing-weighted sum of its experts' outputs.

Only the experts some token of the step was routed to run, each over its own rows, on zero-copy views of
the stacked matrices (memory/weights.row_block); the ids moe_forward returns say which ones ran.
"""

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from kernels.moe import gather_rows, group_by_expert, route_tokens, scatter_rows, weighted_sum
from kernels.norms import silu_mul
from memory.weights import Matrix, WeightMatrix, row_block
from models.linear import linear as linear_f32

Linear = Callable[[np.ndarray, Matrix], np.ndarray]  # (x [T, K] f32, w [N, K]) -> [T, N] f32


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no truth value, so equality is identity
class ExpertWeights:
    """One layer's experts; matrices [out_features, in_features] in a served format, stacked over experts."""

    router: np.ndarray  # [E, hidden] f32, kept float32: the routing choice is sensitive to rounding
    gate_up: Matrix  # [E * 2 * I, hidden]: expert e's gate rows then its up rows
    down: Matrix  # [E * hidden, I]
    num_experts: int
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum 1 (Mixtral; Qwen3-MoE when norm_topk_prob)
    intermediate_size: int
    _views: tuple = field(init=False, repr=False)  # [E] (gate_up_e, down_e)

    def __post_init__(self):
        E, I, hidden = self.num_experts, self.intermediate_size, self.router.shape[-1]
        if self.router.shape != (E, hidden) or self.router.dtype != np.float32:
            raise ValueError(f"router must be float32 [{E}, hidden], got {self.router.dtype} "
                             f"{self.router.shape}")
        if self.gate_up.shape != (E * 2 * I, hidden) or self.down.shape != (E * hidden, I):
            raise ValueError(f"expert matrices gate_up {self.gate_up.shape}, down {self.down.shape} do not "
                             f"stack {E} experts of hidden {hidden}, intermediate {I}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"top_k {self.top_k} must be in [1, {E}]")
        # row_block raises here if an expert's rows would split a packed block of interleaved rows
        views = tuple((row_block(self.gate_up, e * 2 * I, (e + 1) * 2 * I),
                       row_block(self.down, e * hidden, (e + 1) * hidden)) for e in range(E))
        object.__setattr__(self, "_views", views)

    @classmethod
    def from_float(cls, router: np.ndarray, gate_up: np.ndarray, down: np.ndarray, dtype: str, top_k: int,
                   normalize: bool) -> "ExpertWeights":
        """From Hugging Face's stacked tensors: gate_up [E, 2 * I, hidden] (gate | up), down [E, hidden, I];
        the matrices in dtype (WeightMatrix.from_float), the router float32."""
        E, two_i, hidden = gate_up.shape
        return cls(np.ascontiguousarray(router, np.float32),
                   WeightMatrix.from_float(gate_up.reshape(E * two_i, hidden), dtype),
                   WeightMatrix.from_float(down.reshape(E * hidden, two_i // 2), dtype),
                   E, top_k, normalize, two_i // 2)

    def expert(self, e: int) -> tuple[Matrix, Matrix]:
        """Expert e's (gate_up [2 * I, hidden], down [hidden, I]): views into the stacked matrices."""
        return self._views[e]

    def with_matrices(self, gate_up: Matrix, down: Matrix) -> "ExpertWeights":
        """A copy with the stacked matrices swapped (repacked for their activations), the router shared."""
        return replace(self, gate_up=gate_up, down=down)

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + self.gate_up.nbytes + self.down.nbytes


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


def moe_forward(x: np.ndarray, experts: ExpertWeights, linear: Linear) -> tuple[np.ndarray, np.ndarray]:
    """The MoE MLP over a flat token batch: x [T, hidden] f32 -> (out [T, hidden] f32, ids [T, k] int32,
    the experts each token was routed to: those that ran).

    The router runs in float32 (models.linear.linear) whatever the caller's linear; the experts' matrices go
    through `linear`, only the routed experts' views. A token's output is its slots' outputs summed in slot
    order, each from its own row alone: the same bits in any batch."""
    T, hidden = x.shape
    k, I = experts.top_k, experts.intermediate_size
    x = np.ascontiguousarray(x, np.float32)
    logits = linear_f32(x, WeightMatrix("float32", experts.router))  # [T, E]
    ids, weights = route(logits, k, experts.normalize)
    offsets = np.empty(experts.num_experts + 1, np.int64)
    slots = np.empty(T * k, np.int64)
    group_by_expert(ids, offsets, slots)
    # each (token, slot)'s expert output, kept for the slot-order sum: T * k rows (a 512-token chunk, k = 8,
    # hidden 2048: 32 MB)
    y = np.empty((T, k, hidden), np.float32)
    for e in np.flatnonzero(np.diff(offsets)):
        rows = slots[offsets[e]:offsets[e + 1]]  # [n] flat positions t * k + j
        gate_up, down = experts.expert(e)
        xe = np.empty((rows.shape[0], hidden), np.float32)
        gather_rows(x, rows, k, xe)
        act = np.empty((rows.shape[0], I), np.float32)
        silu_mul(linear(xe, gate_up), act)  # [n, 2 * I] -> [n, I]
        scatter_rows(linear(act, down), rows, y.reshape(T * k, hidden))
    out = np.empty((T, hidden), np.float32)
    weighted_sum(y, weights, out)
    return out, ids
