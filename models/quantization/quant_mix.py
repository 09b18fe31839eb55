"""Which format each matrix is quantized to at load: `weight_dtype` everywhere, except the LM head (the most
sensitive matrix: every logit goes through it) and, for the mixes, llama.cpp's choices of more bits.

"q4_k_m" / "q5_k_m" are llama-quantize's Q4_K_M / Q5_K_M: Q4_K (Q5_K) by default, Q6_K for the LM head
and for attn_v and ffn_down in the layers use_more_bits picks (the first and last eighth, and every third
between), a fused attn_qkv one step up (Q5_K / Q6_K), and for 8-expert models attn_k / attn_v in Q8_0 and
attn_output in Q5_K. "iq4_nl" / "iq4_xs" are its IQ4_NL / IQ4_XS: the format by default, Q6_K for the LM
head, Q5_K for attn_v with 4 or more query heads per KV head and, without an importance matrix, for the
first eighth of ffn_down. Matrices are named by their GGUF tensor categories (a
Hugging Face checkpoint's modules map to them in models/checkpoint.py), so a Hugging Face directory and an
F16 GGUF quantize alike; rows that are not whole 256-value super-blocks fall back in
WeightMatrix.from_float as llama.cpp's do (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0).
"""

from models.model_spec import ModelSpec

MIXES = {"q4_k_m": "q4_k", "q5_k_m": "q5_k", "iq4_nl": "iq4_nl", "iq4_xs": "iq4_xs"}  # mix -> its default
# the LM head's format per weight_dtype where it differs (measured for q4_0: benchmarks/results/HISTORY.md)
LM_HEAD = {"q4_0": "q8_0", "q4_k": "q6_k", "q5_k": "q6_k", "q4_k_m": "q6_k", "q5_k_m": "q6_k",
           "iq4_nl": "q6_k", "iq4_xs": "q6_k"}


def lm_head_dtype(weight_dtype: str) -> str:
    """The output projection's (and a tied embedding's) format."""
    return LM_HEAD.get(weight_dtype, weight_dtype)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's choice of layers whose attn_v / ffn_down get more bits in its _M mixes."""
    return layer < num_layers // 8 or layer >= 7 * num_layers // 8 or (layer - num_layers // 8) % 3 == 2


def matrix_dtype(weight_dtype: str, category: str, layer: int, spec: ModelSpec, imatrix: bool = False) -> str:
    """The format of layer `layer`'s matrix of this GGUF category ("attn_q", "attn_k", "attn_v", "attn_qkv",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down"; experts' tensors by their dense category) in a model of
    this spec; imatrix: quantized with an importance matrix (llama.cpp then keeps q4_0's first eighth of
    ffn_down in q4_1, and the IQ4 mixes' in their own format)."""
    num_layers, num_experts, gqa = spec.num_layers, spec.num_experts, spec.num_heads // spec.num_kv_heads
    base = MIXES.get(weight_dtype)
    if imatrix and weight_dtype == "q4_0" and category == "ffn_down" and layer < num_layers // 8:
        return "q4_1"
    if base is None:
        return weight_dtype
    if num_experts == 8 and category in ("attn_k", "attn_v"):
        return "q8_0"
    if num_experts == 8 and category == "attn_output":
        return "q5_k"
    if base in ("iq4_nl", "iq4_xs"):
        if (category == "attn_v" and gqa >= 4) or (category == "ffn_down" and not imatrix
                                                    and layer < num_layers // 8):
            return "q5_k"
        return base
    if category == "attn_qkv":
        return "q5_k" if base == "q4_k" else "q6_k"
    if category in ("attn_v", "ffn_down") and use_more_bits(layer, num_layers):
        return "q6_k"
    return base


def embedding_dtype(weight_dtype: str, tied: bool) -> str:
    """The token embedding's format: the LM head's when tied, else the default one."""
    return lm_head_dtype(weight_dtype) if tied else MIXES.get(weight_dtype, weight_dtype)
