"""Which dtype each linear layer's activations are rounded to, decided once at load time, and why.

`EngineConfig.activation_dtype`:
- "float32": every matrix multiplies float32 activations (exact: within 1e-4 of transformers).
- "int8": q8_0 / q4_0 matrices (the LM head included) get activations quantized per 32-value block and
  integer dot products (kernels/linear_int8.py); other weight formats keep float32 activations.
- "bfloat16": needs a bf16 dot-product instruction (AVX512-BF16's vdpbf16ps). No kernel for it is built
  yet, so it falls back to float32 on every CPU: rounding activations to bf16 and then multiplying in
  float32 would lose precision and gain nothing.
- "auto": "int8" where the matrix is q8_0 / q4_0 and the CPU can run it, float32 elsewhere (measured:
  perplexity within 0.3% of float32 activations on the demo model, 1.6-2.5x the matmul speed; README).
A calibration file beside the model (models/calibration.py: `numaserve calibrate`) can keep chosen
matrices in float32 (its per-matrix fallbacks) and give static activation scales.
Every choice and every fallback is recorded in the engine's decision log (a fallback also as a warning).
"""

from cluster_configs.diagnostics import DecisionLog
from kernels.cpu import missing_features
from memory.weights import Int8Matrix, WeightMatrix

INT8_FEATURES = ("avx2", "f16c")  # vpmaddwd on 256-bit vectors, fp16 scale conversion
BF16_FEATURES = ("avx512bf16",)
_LAYER_MATRICES = ("qkv", "o", "gate_up", "down")


def matrix_names(weights: dict):
    """(name, holder, key) of every matrix whose input the forward pass observes (models/llama.py)."""
    for i, layer in enumerate(weights["layers"]):
        for key in _LAYER_MATRICES:
            yield f"layers.{i}.{key}", layer, key
    yield "lm_head", weights, "lm_head"


def plan_activations(weights: dict, activation_dtype: str, decisions: DecisionLog,
                     calibration: dict | None = None, static_scales: bool = False) -> dict:
    """-> weights with int8-activation matrices repacked (Int8Matrix); the rest unchanged."""
    if activation_dtype == "float32":
        decisions.record("activation_dtype", "float32", "requested: exact float32 activations")
        return weights
    if activation_dtype == "bfloat16":
        missing = missing_features(BF16_FEATURES)
        why = (f"this CPU lacks {', '.join(missing)} (vdpbf16ps)" if missing
               else "the bf16 dot-product kernel is not built yet")
        decisions.record("activation_dtype", "float32", f"bfloat16 activations requested but {why}; "
                         "computing with float32 activations (exact)", warn=True)
        return weights
    missing = missing_features(INT8_FEATURES)
    if missing:
        decisions.record("activation_dtype", "float32", f"activation_dtype={activation_dtype} but this CPU lacks "
                         f"{', '.join(missing)}; computing with float32 activations (exact)",
                         warn=activation_dtype != "auto")
        return weights
    matrices = (calibration or {}).get("matrices", {})
    layers = [dict(layer) for layer in weights["layers"]]
    planned = dict(weights, layers=layers)
    for name, holder, key in matrix_names(planned):
        w = holder[key]
        cal = matrices.get(name)
        if not isinstance(w, WeightMatrix) or w.dtype not in ("q8_0", "q4_0"):
            choice, why = "float32", f"{w.dtype} weights: int8 activations are used with q8_0 / q4_0 weights only"
        elif cal is not None and cal.get("fallback"):
            choice, why = "float32", (f"calibration: int8 error {cal.get('error_dynamic', float('nan')):.3g} "
                                      "exceeds the bound")
        else:
            scale = float(cal["scale"]) if static_scales and cal is not None else 0.0
            holder[key] = Int8Matrix.pack(w, scale)
            choice, why = "int8", (f"{w.dtype} weights, " + (f"static activation scale {scale:.4g} (calibrated)"
                                                              if scale else "dynamic per-block activation scales"))
        decisions.record("activation_dtype", choice, why, subject=name)
    return planned
