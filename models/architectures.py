"""One description per architecture: what differs between the families numaserve serves, as data the loaders
(models/model_spec.py, models/checkpoint.py, the GGUF reader and writer) and the forward (models/decoder.py)
read.

Numeric quirks (embedding, attention, residual and logit multipliers, soft-capping, windows, rope bases) come
from each checkpoint's config into ModelSpec; what is fixed per family (which norms a layer has, how its
tensors are named, the MLP's activation) lives here.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

# A layer's norms by role, in forward order: before attention, on attention's output (before the residual
# add), before the MLP, on the MLP's output. Llama has the first and third; Gemma 2/3 all four ("sandwich");
# OLMo 2 the second and fourth.
NORM_ROLES = ("attn_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
LLAMA_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
POST_NORMS = {"attn_out_norm": "post_attention_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
# llama.cpp's tensor names for the same roles (blk.{i}.<name>.weight)
GGUF_NORMS = {"attn_norm": "attn_norm", "attn_out_norm": "post_attention_norm", "mlp_norm": "ffn_norm",
              "mlp_out_norm": "post_ffw_norm"}


def _full(cfg: dict, n: int) -> tuple[str, ...]:
    return ("full_attention",) * n


def _all_sliding(cfg: dict, n: int) -> tuple[str, ...]:  # Mistral, Mixtral, Phi-3: every layer when set
    return ("sliding_attention" if cfg.get("sliding_window") else "full_attention",) * n


def _qwen_window_layers(cfg: dict, n: int) -> tuple[str, ...]:  # layers from max_window_layers on
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return _full(cfg, n)
    first = cfg.get("max_window_layers", n)
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(n))


def _alternating(cfg: dict, n: int) -> tuple[str, ...]:  # Gemma 2: even layers slide
    return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))


def _every_nth_global(cfg: dict, n: int) -> tuple[str, ...]:  # Gemma 3: every pattern-th layer is global
    pattern = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
    return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n))


def _all_sparse(cfg: dict, n: int) -> tuple[bool, ...]:  # Mixtral
    return (True,) * n


def _qwen_sparse(cfg: dict, n: int) -> tuple[bool, ...]:  # Qwen3-MoE: every step-th, but mlp_only_layers
    dense, step = set(cfg.get("mlp_only_layers") or ()), int(cfg.get("decoder_sparse_step") or 1)
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(n))


@dataclass(frozen=True)
class Experts:
    """How a mixture-of-experts family stores and routes its experts: model.layers.{i}.<block>.gate.weight
    is the router [E, hidden], <block>.experts.{e}.<gate | up | down>.weight an expert's SiLU-gated MLP."""

    block: str  # "mlp" (Qwen3-MoE) | "block_sparse_moe" (Mixtral)
    projections: tuple[str, str, str]  # an expert's gate, up and down tensors
    normalize_key: str | None  # the config key of "renormalise the top-k weights"; None: always
    sparse_layers: Callable[[dict, int], tuple[bool, ...]]  # which layers have experts (the rest dense)


@dataclass(frozen=True)
class Architecture:
    name: str  # Hugging Face's `architectures` entry
    gguf: str  # llama.cpp's general.architecture
    norms: dict[str, str] = field(default_factory=lambda: LLAMA_NORMS)  # role -> name under model.layers.{i}
    qk_norm: str = "none"  # "none" | "head": an RMSNorm over each head [head_dim] | "whole": over all heads
    norm_offset: float = 0.0  # RMSNorm scales by (offset + weight): Gemma stores weight - 1
    activation: str = "silu"  # the MLP's gate activation: "silu" | "gelu_tanh"
    fused_projections: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size) (Gemma)
    qkv_bias: bool = False  # q/k/v biases whatever the config says (Qwen2); else config's attention_bias
    layer_types: Callable[[dict, int], tuple[str, ...]] = _full  # for configs without `layer_types`
    experts: Experts | None = None  # mixture-of-experts layers
    # config.json fields whose default (the transformers config class's, used when a file leaves them out)
    # differs from Llama's
    defaults: dict = field(default_factory=dict)


_GEMMA = {"norms": SANDWICH_NORMS, "norm_offset": 1.0, "activation": "gelu_tanh", "scale_embeddings": True}
_EPS_5 = {"rms_norm_eps": 1e-5}

ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM", "llama"),
    Architecture("MistralForCausalLM", "llama", layer_types=_all_sliding),
    Architecture("Qwen2ForCausalLM", "qwen2", qkv_bias=True, layer_types=_qwen_window_layers),
    Architecture("Qwen3ForCausalLM", "qwen3", qk_norm="head", layer_types=_qwen_window_layers),
    Architecture("Gemma2ForCausalLM", "gemma2", layer_types=_alternating,
                 defaults={"tie_word_embeddings": True}, **_GEMMA),
    Architecture("Gemma3ForCausalLM", "gemma3", qk_norm="head", layer_types=_every_nth_global,
                 defaults={"tie_word_embeddings": True, "rope_theta": 1000000.0,
                           "rope_local_base_freq": 10000.0}, **_GEMMA),
    Architecture("Phi3ForCausalLM", "phi3", fused_projections=True, layer_types=_all_sliding,
                 defaults=_EPS_5),
    Architecture("GraniteForCausalLM", "granite"),
    Architecture("Olmo2ForCausalLM", "olmo2", norms=POST_NORMS, qk_norm="whole", defaults=_EPS_5),
    Architecture("SmolLM3ForCausalLM", "smollm3",
                 defaults={"tie_word_embeddings": True, "rope_theta": 2000000.0}),
    Architecture("Qwen3MoeForCausalLM", "qwen3moe", qk_norm="head", layer_types=_qwen_window_layers,
                 experts=Experts("mlp", ("gate_proj", "up_proj", "down_proj"), "norm_topk_prob",
                                 _qwen_sparse)),
    Architecture("MixtralForCausalLM", "llama", layer_types=_all_sliding,
                 experts=Experts("block_sparse_moe", ("w1", "w3", "w2"), None, _all_sparse),
                 defaults={"rope_theta": 1000000.0} | _EPS_5),
)}


def architecture(name: str) -> Architecture:
    return ARCHITECTURES[name]
