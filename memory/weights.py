"""A model's weights (ModelWeights, its LayerWeights) as the loaders build them and the forward pass reads
them: norms and biases as float32 arrays, matrices in a served format (memory/matrices.py).

The packed cache stores these containers as they are (models/packed/tree.py): a change to the bytes a
packer writes must bump models/packed_cache.LAYOUT_VERSION, or starts would read entries of the old layout."""

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from memory.experts import ExpertWeights
from memory.matrices import Matrix, WeightMatrix

PROJECTIONS = ("qkv", "o", "gate_up", "down")  # a dense layer's matrices in forward order (plans, LoRA)
EXPERT_PROJECTIONS = ("experts.gate_up", "experts.down")  # a MoE layer's in place of gate_up and down


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no truth value, so equality is identity
class LayerWeights:
    """One decoder layer: norms and biases float32, matrices [out_features, in_features] in a served
    format. A norm a family's layers do not have is None (models/architectures.py NORM_ROLES: Llama has
    attn_norm and mlp_norm, Gemma all four, OLMo 2 attn_out_norm and mlp_out_norm). A mixture-of-experts
    layer has experts in place of gate_up and down."""

    qkv: Matrix  # [q_size + 2 * kv_size, hidden]: q | k | v fused
    qkv_bias: np.ndarray | None  # [q_size + 2 * kv_size] f32 (Qwen2), None without
    o: Matrix  # [hidden, q_size]
    gate_up: Matrix | None  # [2 * intermediate, hidden]: gate | up fused; None in a MoE layer
    down: Matrix | None  # [hidden, intermediate]; None in a MoE layer
    attn_norm: np.ndarray | None = None  # [hidden] f32: before attention
    attn_out_norm: np.ndarray | None = None  # [hidden] f32: on attention's output, before the residual add
    mlp_norm: np.ndarray | None = None  # [hidden] f32: before the MLP
    mlp_out_norm: np.ndarray | None = None  # [hidden] f32: on the MLP's output, before the residual add
    q_norm: np.ndarray | None = None  # [head_dim] (per head) | [q_size] (all heads) f32
    k_norm: np.ndarray | None = None  # [head_dim] | [kv_size] f32
    experts: ExpertWeights | None = None  # a MoE layer's router and experts (memory/experts.py)

    @property
    def projections(self) -> tuple[str, ...]:
        """The names of this layer's matrices, in forward order: PROJECTIONS, or with EXPERT_PROJECTIONS in
        place of the MLP's."""
        return PROJECTIONS if self.experts is None else PROJECTIONS[:2] + EXPERT_PROJECTIONS

    def projection(self, name: str) -> Matrix | None:
        """The matrix of a projection named in PROJECTIONS or EXPERT_PROJECTIONS (None where the layer has
        none: a MoE layer's gate_up, a dense layer's experts)."""
        if name in EXPERT_PROJECTIONS:
            return None if self.experts is None else getattr(self.experts, name.split(".")[1])
        return getattr(self, _projection(name))

    def with_projection(self, name: str, matrix: Matrix) -> "LayerWeights":
        """A copy with that projection's matrix swapped (the rest shared)."""
        if name in EXPERT_PROJECTIONS:
            e = self.experts
            gate_up, down = (matrix, e.down) if name == "experts.gate_up" else (e.gate_up, matrix)
            return replace(self, experts=e.with_matrices(gate_up, down))
        return replace(self, **{_projection(name): matrix})

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.qkv, self.qkv_bias, self.o, self.gate_up, self.down,
                                      self.attn_norm, self.attn_out_norm, self.mlp_norm, self.mlp_out_norm,
                                      self.q_norm, self.k_norm, self.experts) if a is not None)


# what a loader applies to each layer as it builds it, (index, layer) -> layer: the activation plan
# (models/quantization/activation_plan.ActivationPlan.layer), so that unplanned layers do not pile up
LayerHook = Callable[[int, LayerWeights], LayerWeights]


def as_built(i: int, layer: LayerWeights) -> LayerWeights:
    """The LayerHook that keeps each layer as the loader built it."""
    return layer


@dataclass(frozen=True, eq=False)
class ModelWeights:
    embed: WeightMatrix  # [vocab, hidden]
    norm: np.ndarray  # [hidden] f32: the final norm
    lm_head: Matrix  # [vocab, hidden]: embed itself when tied (until packed for its activations)
    layers: tuple[LayerWeights, ...]  # [num_layers]

    @property
    def nbytes(self) -> int:
        head = 0 if self.lm_head is self.embed else self.lm_head.nbytes
        return self.embed.nbytes + self.norm.nbytes + head + sum(layer.nbytes for layer in self.layers)


def _projection(name: str) -> str:
    if name not in PROJECTIONS:
        raise ValueError(f"{name!r} is not a layer projection; one of {PROJECTIONS}")
    return name
