"""llama.cpp's GGUF architectures numaserve reads and writes, as data: per family, what its files leave to
llama.cpp's code (rope layout, defaults for absent keys, built-in window and no-rope patterns), and the
tensors a layer's weights are stored as.

The families follow llama.cpp's convert_hf_to_gguf.py: Llama, Granite and SmolLM3 rotate adjacent pairs
("normal" rope), so the converter interleaves the two halves of every head of attn_q / attn_k (and their
biases); the NEOX-rope families (Qwen 2/3, Gemma 2/3, Phi-3, OLMo 2) keep Hugging Face's row order. Gemma's
norms are stored with the +1 added, as numaserve's LayerWeights hold them.
"""

from dataclasses import dataclass, field

import numpy as np

from cluster_configs.errors import CheckpointError
from models.architectures import GGUF_NORMS
from models.gguf.format import rope_row_order
from models.model_spec import ModelSpec


@dataclass(frozen=True)
class GGUFFamily:
    name: str  # general.architecture
    architecture: str  # the models/architectures.py entry its files load as
    interleaved_rope: bool = False  # llama.cpp's "normal" rope: q/k rows permuted by the converter
    # what llama.cpp assumes for a key (under {name}.) a file leaves out
    implied: dict[str, float] = field(default_factory=dict)
    required: tuple[str, ...] = ()  # multiplier keys llama.cpp refuses a file without (Granite)
    plain_swa_rope: float = 0.0  # sliding layers: plain rope of this base unless rope.freq_base_swa (Gemma 3)
    no_rope_period: int = 0  # every n-th layer has no rope (SmolLM3: 4; llama.cpp has no key for it)
    # Gemma: scores scaled by query_pre_attn_scalar ** -0.5, taken as the head size or, for these block counts
    # (the 27B models), as hidden / heads; None: 1 / sqrt(head_dim) unless attention.scale says otherwise
    wide_query_scalar: tuple[int, ...] | None = None
    # the architecture its files load as when they have experts ({name}.expert_count > 0): Mixtral is a
    # llama file with experts; "" for a family without (a MoE family's own architecture has them)
    with_experts: str = ""


FAMILIES: dict[str, GGUFFamily] = {f.name: f for f in (
    GGUFFamily("llama", "LlamaForCausalLM", interleaved_rope=True, with_experts="MixtralForCausalLM"),
    GGUFFamily("qwen2", "Qwen2ForCausalLM"),
    GGUFFamily("qwen3", "Qwen3ForCausalLM"),
    GGUFFamily("gemma2", "Gemma2ForCausalLM", wide_query_scalar=(46,),
               implied={"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                        "attention.sliding_window": 4096}),
    GGUFFamily("gemma3", "Gemma3ForCausalLM", plain_swa_rope=10000.0, wide_query_scalar=(62,)),
    GGUFFamily("phi3", "Phi3ForCausalLM"),
    GGUFFamily("granite", "GraniteForCausalLM", interleaved_rope=True,
               required=("embedding_scale", "residual_scale", "attention.scale", "logit_scale")),
    GGUFFamily("olmo2", "Olmo2ForCausalLM"),
    GGUFFamily("smollm3", "SmolLM3ForCausalLM", interleaved_rope=True, no_rope_period=4),
    GGUFFamily("qwen3moe", "Qwen3MoeForCausalLM", with_experts="Qwen3MoeForCausalLM"),
)}


def gguf_family(path, name) -> GGUFFamily:
    """The family of a file's general.architecture, or CheckpointError naming the supported ones."""
    if name not in FAMILIES:
        raise CheckpointError(f"{path}: general.architecture={name!r} is not supported; numaserve loads GGUF "
                              f"files of {', '.join(map(repr, FAMILIES))}; serve the Hugging Face directory "
                              "instead")
    return FAMILIES[name]


# ---- tensors ---------------------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class TensorSlot:
    """One tensor of a layer (blk.{i}.<name>) holding rows of a LayerWeights field."""

    name: str  # "attn_q.weight"
    rows: np.ndarray | None  # the field's rows it holds, in the file's order; None: the whole field
    shape: tuple[int, ...]  # numpy order: [rows, in_features] or [rows]


Layout = tuple[TensorSlot, ...]  # the tensors a field is stacked from, by rows


def layer_layouts(spec: ModelSpec, family: GGUFFamily, layer: int) -> dict[str, tuple[Layout, ...]]:
    """LayerWeights field -> the layouts its tensors may have in a file, the family's own first (the one
    written). q|k|v and gate|up are separate tensors or fused (Phi-3's attn_qkv, and its ffn_up holding
    gate|up). A MoE layer has EXPERT_FIELDS in place of gate_up and down: llama.cpp's merged expert tensors,
    ffn_gate_exps and ffn_up_exps [E, I, hidden] (each expert's gate and up rows, which our stacked gate_up
    interleaves expert by expert), ffn_down_exps [E, hidden, I] and the router ffn_gate_inp [E, hidden]."""
    h, q, kv, inter, D = spec.hidden_size, spec.q_size, spec.kv_size, spec.intermediate_size, spec.head_dim
    arch = spec.arch
    q_rows, k_rows = np.arange(q), q + np.arange(kv)
    if family.interleaved_rope:
        q_rows, k_rows = rope_row_order(spec.num_heads, D), q + rope_row_order(spec.num_kv_heads, D)
    qkv_rows = (q_rows, k_rows, np.arange(q + kv, q + 2 * kv))
    gate_up_rows = (np.arange(inter), np.arange(inter, 2 * inter))

    def whole(name: str, shape: tuple[int, ...]) -> tuple[Layout]:
        return ((TensorSlot(name, None, shape),),)

    def stacked(split: tuple[str, ...], fused: str, rows: tuple[np.ndarray, ...], suffix: str,
                cols: tuple[int, ...]) -> tuple[Layout, Layout]:
        apart = tuple(TensorSlot(f"{n}.{suffix}", r, (len(r), *cols)) for n, r in zip(split, rows))
        joined = np.concatenate(rows)
        together = (TensorSlot(f"{fused}.{suffix}", joined, (len(joined), *cols)),)
        return (together, apart) if arch.fused_projections else (apart, together)

    layouts = {role: whole(GGUF_NORMS[role] + ".weight", (h,)) for role in arch.norms}
    if arch.qk_norm != "none":
        per_head = arch.qk_norm == "head"
        layouts |= {"q_norm": whole("attn_q_norm.weight", (D if per_head else q,)),
                    "k_norm": whole("attn_k_norm.weight", (D if per_head else kv,))}
    layouts["qkv"] = stacked(("attn_q", "attn_k", "attn_v"), "attn_qkv", qkv_rows, "weight", (h,))
    if spec.qkv_bias:
        layouts["qkv_bias"] = stacked(("attn_q", "attn_k", "attn_v"), "attn_qkv", qkv_rows, "bias", ())
    layouts["o"] = whole("attn_output.weight", (h, q))
    if spec.is_moe(layer):
        return layouts | _expert_layouts(spec)
    layouts["gate_up"] = stacked(("ffn_gate", "ffn_up"), "ffn_up", gate_up_rows, "weight", (h,))
    layouts["down"] = whole("ffn_down.weight", (h, inter))
    return layouts


EXPERT_FIELDS = ("experts.router", "experts.gate_up", "experts.down")  # ExpertWeights' router, gate_up, down


def _expert_layouts(spec: ModelSpec) -> dict[str, tuple[Layout]]:
    """The experts a shard holds (all but under expert parallelism), each one's rows it holds (all but
    without), every expert's router."""
    first, end = spec.held_experts or (0, spec.num_experts)
    E, I, h = end - first, spec.moe_intermediate_size, spec.hidden_size
    ours = np.arange(E * 2 * I).reshape(E, 2, I)  # our stacked gate_up's rows: expert, gate | up, row
    return {"experts.router": ((TensorSlot("ffn_gate_inp.weight", None, (spec.num_experts, h)),),),
            "experts.gate_up": ((TensorSlot("ffn_gate_exps.weight", ours[:, 0].reshape(-1), (E, I, h)),
                                 TensorSlot("ffn_up_exps.weight", ours[:, 1].reshape(-1), (E, I, h))),),
            "experts.down": ((TensorSlot("ffn_down_exps.weight", None, (E, h, I)),),)}


def layer_field(layer, field: str):
    """A LayerWeights field of layer_layouts, an ExpertWeights one for EXPERT_FIELDS."""
    if field in EXPERT_FIELDS:
        return getattr(layer.experts, field.split(".")[1])
    return getattr(layer, field)


def has_qkv_bias(shapes: dict[str, tuple[int, ...]]) -> bool:
    """Whether the file's layers have q/k/v biases (all three, or fused)."""
    return "blk.0.attn_qkv.bias" in shapes or all(f"blk.0.attn_{n}.bias" in shapes for n in "qkv")
