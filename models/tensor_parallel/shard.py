"""Which part of each checkpoint tensor a tensor-parallel rank holds, by its Hugging Face name (vLLM's column-
and row-parallel layers): attention by groups of KV heads (each rank its KV heads and their query heads; a KV
head replicated where there are fewer than ranks), the MLP's gate and up by rows and down by columns, each
expert's likewise (or, under expert parallelism, each expert whole on one rank: E / N experts a rank, vLLM's
enable_expert_parallel), the vocabulary by rows of the embedding and the LM head; norms and routers whole.

A rank's spec (`local_spec`) is the model's with its own head and intermediate counts, so the forward, the KV
cache and the loaders run unchanged on a shard; what its partial results need (an all-reduce after o and
down, the vocabulary's offsets) is the forward's collectives (models/tensor_parallel/collectives.py)."""

import re
from dataclasses import dataclass, replace

import numpy as np

from cluster_configs.errors import CheckpointError
from models.model_spec import ModelSpec

Span = tuple[int, int]  # [lo, hi)


@dataclass(frozen=True)
class TensorShard:
    rank: int
    size: int
    expert_parallel: bool = False  # a MoE layer's experts whole on ranks, not each one's matrices split

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} of a group of {self.size}")

    def span(self, n: int) -> Span:
        """This rank's share of n rows (the shares differ by at most one)."""
        return self.rank * n // self.size, (self.rank + 1) * n // self.size

    def head_spans(self, spec: ModelSpec) -> tuple[Span, Span]:
        """-> (its query heads, its KV heads): the query heads split evenly, each rank with the KV heads
        its query heads read."""
        h, kv, n = spec.num_heads, spec.num_kv_heads, self.size
        if h % n or (kv % n and n % kv):
            raise CheckpointError(
                f"{spec.architecture} has {h} query and {kv} KV heads: tensor_parallel_size {n} must divide "
                "the query heads and divide, or be a multiple of, the KV heads; pick a size that does")
        q_lo, q_hi = self.span(h)
        group = h // kv
        return (q_lo, q_hi), (q_lo // group, (q_hi - 1) // group + 1)

    def local_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec of this rank's shard: its heads and intermediate sizes (vocabulary and hidden size whole:
        token ids and the residual stream are the model's)."""
        if self.size == 1:
            return spec
        if spec.arch.qk_norm == "whole":
            raise CheckpointError(f"{spec.architecture} normalizes q and k over all heads at once, which a "
                                  "shard of the heads cannot; serve it with tensor_parallel_size 1")
        experts_whole = self.expert_parallel and spec.num_experts > 0
        if experts_whole and spec.num_experts < self.size:
            raise CheckpointError(f"{spec.architecture} has {spec.num_experts} experts: expert parallelism "
                                  f"places them whole, at least one on each of tensor_parallel_size "
                                  f"{self.size} ranks; use a smaller size or leave enable_expert_parallel "
                                  "off")
        split = [("intermediate_size", spec.intermediate_size)]
        if not experts_whole:
            split.append(("moe_intermediate_size", spec.moe_intermediate_size))
        for name, n in split:
            if n % self.size:
                raise CheckpointError(f"{spec.architecture}'s {name} {n} does not split into "
                                      f"tensor_parallel_size {self.size} equal parts; pick a size that "
                                      "divides it")
        (q_lo, q_hi), (kv_lo, kv_hi) = self.head_spans(spec)
        expert_parts = 1 if experts_whole else self.size
        return replace(spec, num_heads=q_hi - q_lo, num_kv_heads=kv_hi - kv_lo,
                       intermediate_size=spec.intermediate_size // self.size,
                       moe_intermediate_size=spec.moe_intermediate_size // expert_parts,
                       held_experts=self.span(spec.num_experts) if experts_whole else None)

    def pieces(self, name: str, spec: ModelSpec) -> tuple[int, list[Span]] | None:
        """-> (axis, the spans along it, concatenated in order) of the Hugging Face tensor `name` this rank
        holds; None: the whole tensor."""
        return None if self.size == 1 else self._plan(_role(name, spec), spec)

    def gguf_pieces(self, name: str, spec: ModelSpec) -> tuple[int, list[Span]] | None:
        """pieces for llama.cpp's tensor `name` (blk.{i}.attn_q.weight, ...): the same plan, and llama.cpp's
        merged expert tensors [E, rows, in] split along the experts (expert parallel), the rows (gate, up)
        or the columns (down)."""
        return None if self.size == 1 else self._plan(_gguf_role(name, spec), spec)

    def _plan(self, role: str | None, spec: ModelSpec) -> tuple[int, list[Span]] | None:
        D = spec.head_dim
        (q_lo, q_hi), (kv_lo, kv_hi) = self.head_spans(spec)
        q_rows, kv_rows = (q_lo * D, q_hi * D), (kv_lo * D, kv_hi * D)
        inter = self.span(spec.intermediate_size)
        if role == "vocab":
            return 0, [self.span(spec.vocab_size)]
        if role in ("q", "k", "v"):
            return 0, [q_rows if role == "q" else kv_rows]
        if role == "qkv":  # fused q | k | v
            q, kv = spec.q_size, spec.kv_size
            return 0, [q_rows, (q + kv_rows[0], q + kv_rows[1]), (q + kv + kv_rows[0], q + kv + kv_rows[1])]
        if role == "o":
            return 1, [q_rows]
        if role in ("gate", "up"):
            return 0, [inter]
        if role == "gate_up":  # fused gate | up
            n = spec.intermediate_size
            return 0, [inter, (n + inter[0], n + inter[1])]
        if role == "down":
            return 1, [inter]
        if role in ("expert_in", "expert_out"):
            if self.expert_parallel:  # whole, on the rank that holds it (local_spec's held_experts)
                return None
            span = self.span(spec.moe_intermediate_size)
            return (0 if role == "expert_in" else 1), [span]
        if role in ("experts_in", "experts_out"):  # every expert's, merged: [E, rows, in]
            if self.expert_parallel:
                return 0, [self.span(spec.num_experts)]
            return (1 if role == "experts_in" else 2), [self.span(spec.moe_intermediate_size)]
        return None

    def lora_factors(self, module_key: str, spec: ModelSpec, a: np.ndarray,
                     b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """This rank's (A [r, in], B [out, r]) of a LoRA on the module `module_key` (its weight's name without
        ".weight"): B's rows where the base weight is split by rows (its outputs are the rank's), A's columns
        where by columns (its partial product joins the base's in the all-reduce after it)."""
        plan = self.pieces(module_key + ".weight", spec)
        if plan is None:
            return a, b
        axis, spans = plan
        if axis == 0:
            return a, np.ascontiguousarray(np.concatenate([b[lo:hi] for lo, hi in spans]))
        return np.ascontiguousarray(np.concatenate([a[:, lo:hi] for lo, hi in spans], axis=1)), b

    def take(self, name: str, spec: ModelSpec, tensor: np.ndarray) -> np.ndarray:
        """This rank's part of the whole tensor `name` (a copy: the whole one can go)."""
        plan = self.pieces(name, spec)
        if plan is None:
            return tensor
        axis, spans = plan
        parts = [tensor[lo:hi] if axis == 0 else tensor[:, lo:hi] for lo, hi in spans]
        return np.ascontiguousarray(np.concatenate(parts, axis=axis) if len(parts) > 1 else parts[0])


WHOLE_MODEL = TensorShard(0, 1)

_ROLES = (  # name pattern (after model.layers.{i}.) -> role; the first match wins
    (r"self_attn\.qkv_proj\.weight", "qkv"),
    (r"self_attn\.([qkv])_proj\.(weight|bias)", None),  # role q, k or v
    (r"self_attn\.o_proj\.weight", "o"),
    (r"mlp\.gate_up_proj\.weight", "gate_up"),
    (r"mlp\.gate_proj\.weight", "gate"),
    (r"mlp\.up_proj\.weight", "up"),
    (r"mlp\.down_proj\.weight", "down"),
)


_GGUF_ROLES = (  # llama.cpp's name (after blk.{i}.) -> role; ffn_up is gate | up where the family fuses them
    (r"attn_qkv\.(weight|bias)", "qkv"),
    (r"attn_([qkv])\.(weight|bias)", None),
    (r"attn_output\.weight", "o"),
    (r"ffn_gate\.weight", "gate"),
    (r"ffn_up\.weight", "up"),
    (r"ffn_down\.weight", "down"),
    (r"ffn_(gate|up)_exps\.weight", "experts_in"),
    (r"ffn_down_exps\.weight", "experts_out"),
)


def _gguf_role(name: str, spec: ModelSpec) -> str | None:
    if name in ("token_embd.weight", "output.weight"):
        return "vocab"
    m = re.fullmatch(r"blk\.\d+\.(.+)", name)
    role = None if m is None else _table_role(_GGUF_ROLES, m.group(1))
    return "gate_up" if role == "up" and spec.arch.fused_projections else role


def _table_role(table: tuple, rest: str) -> str | None:
    """The role of the first pattern of table that rest matches (None in a pattern: its first group)."""
    for pattern, role in table:
        hit = re.fullmatch(pattern, rest)
        if hit is not None:
            return role or hit.group(1)
    return None


def _role(name: str, spec: ModelSpec) -> str | None:
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "vocab"
    m = re.fullmatch(r"model\.layers\.\d+\.(.+)", name)
    if m is None:
        return None
    rest = m.group(1)
    experts = spec.arch.experts
    if experts is not None:
        e = re.fullmatch(re.escape(experts.block) + r"\.experts\.\d+\.(\w+)\.weight", rest)
        if e is not None:
            return "expert_out" if e.group(1) == experts.projections[2] else "expert_in"
    return _table_role(_ROLES, rest)
