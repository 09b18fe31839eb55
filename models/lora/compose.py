"""A new adapter from weighted adapters, with PEFT's add_weighted_adapter semantics for
"cat", "linear", "svd".

Per module, over the adapters that adapt it (weights w_i, scalings s_i):
- cat:    A = [w_1 s_1 A_1; w_2 s_2 A_2; ...], B = [B_1, B_2, ...]: exactly sum_i w_i s_i B_i A_i;
- linear: A = sum_i sign(w_i s_i) sqrt|w_i s_i| A_i, B = sum_i sqrt|w_i s_i| B_i: the product has cross
  terms (PEFT calls it a rough approximation); every adapter must have the same rank;
- svd:    the best rank-R approximation of sum_i w_i s_i B_i A_i, R = the largest adapter rank.
The new adapter's config is the first adapter's with r = lora_alpha = R (cat: the sum of the ranks), so
its scaling is 1, or sqrt(R) when the first adapter uses rsLoRA, as in PEFT. One adapter alone is
combined "linear", as in PEFT.
"""

import math
from collections.abc import Sequence

import numpy as np

from cluster_configs.errors import AdapterError
from models.lora.adapter import LoraAdapter, LoraModule

COMBINATIONS = ("cat", "linear", "svd")


def compose(name: str, parts: Sequence[tuple[LoraAdapter, float]], combination: str) -> LoraAdapter:
    if combination not in COMBINATIONS:
        raise AdapterError(f"combination={combination!r} is not supported; "
                           f"use one of {', '.join(COMBINATIONS)}")
    if not parts:
        raise AdapterError("compose needs at least one adapter and its weight, "
                           "e.g. {'tests': 0.7, 'library': 0.3}")
    for adapter, weight in parts:
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
            raise AdapterError(f"the weight of adapter {adapter.name!r} must be a finite number, "
                               f"got {weight!r}")
    if len(parts) == 1:
        combination = "linear"
    ranks = [adapter.config_rank for adapter, _ in parts]
    if combination == "linear" and len(set(ranks)) > 1:
        raise AdapterError(f"combination='linear' needs adapters of one rank, got ranks {ranks}; "
                           "use 'cat' or 'svd'")
    new_rank = sum(ranks) if combination == "cat" else max(ranks)
    scaling = math.sqrt(new_rank) if parts[0][0].use_rslora else 1.0  # alpha = r = new_rank
    layers = []
    for i in range(len(parts[0][0].layers)):
        modules = {m for adapter, _ in parts for m in adapter.layers[i]}
        layers.append({m: _combine([(a.layers[i][m], w) for a, w in parts if m in a.layers[i]], combination,
                                   new_rank, scaling, f"layer {i} {m}") for m in sorted(modules)})
    return LoraAdapter(name, tuple(layers), new_rank, parts[0][0].use_rslora, parts[0][0].fused)


def _combine(loras: list[tuple[LoraModule, float]], combination: str, new_rank: int, scaling: float,
             where: str) -> LoraModule:
    """The combined module; its output is scaling * B A, like PEFT's composed module (scaling != 1 only
    with rsLoRA, where PEFT scales the combination again by sqrt(R))."""
    if combination == "cat":
        a = np.concatenate([m.a * np.float32(w) * np.float32(m.scaling) for m, w in loras])  # in PEFT's order
        b = np.concatenate([m.b for m, _ in loras], axis=1)
    elif combination == "linear":
        if len({m.rank for m, _ in loras}) > 1:
            raise AdapterError(f"combination='linear': {where} has ranks {[m.rank for m, _ in loras]} in the "
                               "adapters (rank_pattern); use 'cat' or 'svd'")
        roots = [(math.copysign(math.sqrt(abs(w * m.scaling)), w * m.scaling), math.sqrt(abs(w * m.scaling)))
                 for m, w in loras]
        a = sum(sa * m.a.astype(np.float64) for (sa, _), (m, _) in zip(roots, loras))
        b = sum(sb * m.b.astype(np.float64) for (_, sb), (m, _) in zip(roots, loras))
    else:
        delta = sum(w * m.scaling * (m.b.astype(np.float64) @ m.a.astype(np.float64)) for m, w in loras)
        u, s, vh = np.linalg.svd(delta, full_matrices=False)  # [out, k], [k], [k, in]
        a = vh[:new_rank]
        b = u[:, :new_rank] * s[:new_rank]
    return LoraModule(np.ascontiguousarray(a, np.float32), np.ascontiguousarray(b, np.float32), scaling)
