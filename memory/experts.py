"""A mixture-of-experts layer's weights: the router and the experts' matrices stacked (models/moe/layer.py
runs them)."""

from dataclasses import dataclass, field, replace

import numpy as np

from memory.matrices import Matrix, WeightMatrix, row_block


@dataclass(frozen=True, eq=False)  # eq=False: arrays have no truth value, so equality is identity
class ExpertWeights:
    """One layer's experts; matrices [out_features, in_features] in a served format, stacked over the experts
    held: all of them, or under expert parallelism a rank's experts first_expert.. (E_held of the E the router
    chooses among; the others' pairs are another rank's)."""

    router: np.ndarray  # [E, hidden] f32, kept float32: the routing choice is sensitive to rounding
    gate_up: Matrix  # [E * 2 * I, hidden]: expert e's gate rows then its up rows
    down: Matrix  # [E * hidden, I]
    num_experts: int
    top_k: int
    normalize: bool  # renormalise the top-k weights to sum 1 (Mixtral; Qwen3-MoE when norm_topk_prob)
    intermediate_size: int
    first_expert: int = 0  # the first expert held; E_held = gate_up's rows // 2I
    _views: tuple = field(init=False, repr=False)  # [E] (gate_up_e, down_e)

    def __post_init__(self):
        E, I, hidden = self.num_experts, self.intermediate_size, self.router.shape[-1]
        if self.router.shape != (E, hidden) or self.router.dtype != np.float32:
            raise ValueError(f"router must be float32 [{E}, hidden], got {self.router.dtype} "
                             f"{self.router.shape}")
        held = self.gate_up.shape[0] // (2 * I)
        if self.gate_up.shape != (held * 2 * I, hidden) or self.down.shape != (held * hidden, I):
            raise ValueError(f"expert matrices gate_up {self.gate_up.shape}, down {self.down.shape} do not "
                             f"stack experts of hidden {hidden}, intermediate {I}")
        if not (held >= 1 and 0 <= self.first_expert and self.first_expert + held <= E):
            raise ValueError(f"experts {self.first_expert}..{self.first_expert + held - 1} held of {E}")
        if not 1 <= self.top_k <= E:
            raise ValueError(f"top_k {self.top_k} must be in [1, {E}]")
        # row_block raises here if an expert's rows would split a packed block of interleaved rows
        views = tuple((row_block(self.gate_up, e * 2 * I, (e + 1) * 2 * I),
                       row_block(self.down, e * hidden, (e + 1) * hidden)) for e in range(held))
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

    @property
    def held(self) -> tuple[int, int]:
        """[first, end) of the experts held."""
        return self.first_expert, self.first_expert + len(self._views)

    def expert(self, e: int) -> tuple[Matrix, Matrix]:
        """Held expert e's (gate_up [2 * I, hidden], down [hidden, I]): views into the stacked matrices."""
        return self._views[e - self.first_expert]

    def with_matrices(self, gate_up: Matrix, down: Matrix) -> "ExpertWeights":
        """A copy with the stacked matrices swapped (repacked for their activations), the router shared."""
        return replace(self, gate_up=gate_up, down=down)

    @property
    def nbytes(self) -> int:
        return self.router.nbytes + self.gate_up.nbytes + self.down.nbytes
