"""Which dtype each linear layer's activations are rounded to, decided once at load time, and why.

`EngineConfig.activation_dtype`:
- "float32": every matrix multiplies float32 activations (exact: within 1e-4 of transformers).
- "int8": quantized matrices (q8_0, q4_0 and the GGML block formats; the LM head included) get activations
  quantized per 32-value block and integer dot products (kernels/linear/int8.py; the block formats:
  kernels/linear/kquant.py and kernels/linear/q6k.py, through VNNI or AVX2 (IQ4's through VNNI only));
  other weight formats keep float32 activations.
- "bfloat16": bf16 matrices (the LM head included) get activations rounded to bf16 and AVX512-BF16's
  vdpbf16ps (kernels/linear/bf16.py); other weight formats keep float32 activations. A CPU without the
  instruction falls back to float32: rounding activations to bf16 and then multiplying in float32 would
  lose precision and gain nothing.
- "auto": "int8" where the matrix is quantized and the CPU can run it, float32 elsewhere: faster matmuls,
  perplexity within 0.3% of float32 activations (tests/models/test_activation_quality.py; the figures:
  benchmarks/results/HISTORY.md).
A calibration file beside the model (models/quantization/calibration.py, written by `numaserve calibrate`)
keeps the matrices it marks (int8 error above its bound) in float32, and holds static per-tensor activation
scales. Dynamic per-block scales stay the default even with a file: they measured both more accurate and as
fast (benchmarks/bench_calibration.py, benchmarks/results/HISTORY.md); `static_scales=True`
(EngineConfig.activation_scales="static") uses the file's scales and falls back where their error exceeds the
bound. Every choice and every fallback goes to the engine's decision log (a fallback also as a warning).
"""

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace

from cluster_configs.diagnostics import DecisionLog
from cluster_configs.errors import CheckpointError
from kernels.formats.ggml_blocks import BLOCK_DTYPES
from kernels.simd.bf16 import BF16_FEATURES
from kernels.simd.cpu import missing_features
from kernels.simd.int8 import AVX2_FEATURES
from memory.matrices import Bf16Matrix, BlockInt8Matrix, Int8Matrix, Matrix, WeightMatrix, map_parts, parts
from memory.weights import LayerWeights, ModelWeights
from models.quantization.calibration import Calibration, MatrixCalibration, check_fits

# vpmaddwd on 256-bit vectors, fp16 scale conversion (and VNNI where present)
INT8_FEATURES = AVX2_FEATURES
INT8_DTYPES = ("q8_0", "q4_0", *BLOCK_DTYPES)  # the weight formats with an int8-activation kernel


def linear_matrices(weights: ModelWeights) -> Iterator[tuple[str, str, Matrix]]:
    """(name, layer type, matrix) of every matrix whose input the forward pass observes (models/decoder.py):
    "layers.{i}.{key}", key | "lm_head", "lm_head" (key: a layer's projections, a MoE layer's experts')."""
    for i, layer in enumerate(weights.layers):
        for key in layer.projections:
            yield f"layers.{i}.{key}", key, layer.projection(key)
    yield "lm_head", "lm_head", weights.lm_head


def with_linear_matrices(weights: ModelWeights, choose: Callable[[str, Matrix], Matrix]) -> ModelWeights:
    """A copy with each matrix of linear_matrices (name, w) replaced by choose(name, w), called in that
    order."""
    return replace(weights, layers=tuple(with_layer_matrices(i, layer, choose)
                                         for i, layer in enumerate(weights.layers)),
                   lm_head=choose("lm_head", weights.lm_head))


def with_layer_matrices(i: int, layer: LayerWeights, choose: Callable[[str, Matrix], Matrix]) -> LayerWeights:
    """Layer i with each matrix replaced by choose(name, w), named as linear_matrices names them."""
    for key in layer.projections:
        layer = layer.with_projection(key, choose(f"layers.{i}.{key}", layer.projection(key)))
    return layer


def plan_activations(weights: ModelWeights, activation_dtype: str, decisions: DecisionLog,
                     calibration: Calibration | None = None, static_scales: bool = False) -> ModelWeights:
    """-> weights with int8-activation matrices repacked (Int8Matrix); the rest unchanged. Records each
    matrix's activation dtype and, per layer type, the kernel and dtypes it runs with (record_kernels).

    Raises CheckpointError if the calibration file was made for another model shape, or static scales are
    asked for without one."""
    plan = ActivationPlan(activation_dtype, decisions, calibration, static_scales, len(weights.layers),
                          any(layer.experts is not None for layer in weights.layers))
    return plan.finish(replace(weights, layers=tuple(plan.layer(i, layer)
                                                     for i, layer in enumerate(weights.layers))))


class ActivationPlan:
    """plan_activations in two parts, so that a loader can plan each layer as it builds it (models/loader.py's
    each_layer): a load then holds one unplanned layer at a time rather than a second copy of the model.
    layer(i, layer) for every layer in order, then finish(weights) with the planned layers."""

    def __init__(self, activation_dtype: str, decisions: DecisionLog, calibration: Calibration | None,
                 static_scales: bool, num_layers: int, moe: bool):
        """moe: whether any layer has experts. Raises CheckpointError as plan_activations does."""
        if static_scales and calibration is None:
            raise CheckpointError("activation_scales='static' takes its scales from the model's calibration "
                                  "file, and there is none: run `numaserve calibrate MODEL` first, or use "
                                  "activation_scales='dynamic'")
        if calibration is not None and moe:
            _calibration_unused(calibration, decisions, "calibration files describe dense models only")
            calibration = None
        if calibration is not None:
            check_fits(calibration, num_layers)
        self.decisions, self.calibration, self.static_scales = decisions, calibration, static_scales
        self.fallbacks: list[str] = []  # the matrices calibration keeps in float32
        self.int8 = False  # whether matrices are planned for int8 activations (_chooser decides)
        self._choose_part = self._chooser(activation_dtype)  # (name, part) -> part; None: all unchanged

    def layer(self, i: int, layer: LayerWeights) -> LayerWeights:
        return with_layer_matrices(i, layer, self._matrix)

    def finish(self, weights: ModelWeights) -> ModelWeights:
        """weights (their layers planned by layer()) with the LM head planned; the records made."""
        planned = replace(weights, lm_head=self._matrix("lm_head", weights.lm_head))
        if self.int8 and self.calibration is not None:
            c, fallbacks = self.calibration, self.fallbacks
            note = "" if c.weight_dtype == planned.layers[0].qkv.dtype else (
                f"; its errors were measured with {c.weight_dtype} weights")
            self.decisions.record(
                "calibration", "used", f"{c.path or 'not from a file'}: {c.method} scales "
                f"({'static, used' if self.static_scales else 'dynamic scales used; static ones unused'})"
                f", bound {c.bound:g}, {c.num_tokens} tokens of {c.text}{note}; "
                f"float32 activations for {len(fallbacks)} matrices"
                + (f": {', '.join(fallbacks)}" if fallbacks else ""), warn=bool(fallbacks))
        record_kernels(planned, self.decisions)
        return planned

    def _matrix(self, name: str, w: Matrix) -> Matrix:
        """w planned, a StackedMatrix part by part."""
        if self._choose_part is None:
            return w
        return map_parts(w, lambda part: self._choose_part(name, part))

    def _chooser(self, activation_dtype: str) -> Callable[[str, Matrix], Matrix] | None:
        decisions, calibration = self.decisions, self.calibration
        if activation_dtype == "float32":
            decisions.record("activation_dtype", "float32", "requested: exact float32 activations")
            _calibration_unused(calibration, decisions, "activation_dtype=float32")
            return None
        if activation_dtype == "bfloat16":
            missing = missing_features(BF16_FEATURES)
            if missing:
                decisions.record("activation_dtype", "float32",
                                 f"bfloat16 activations requested but this CPU lacks "
                                 f"{', '.join(missing)} (vdpbf16ps); computing with float32 activations "
                                 "(exact)", warn=True)
                _calibration_unused(calibration, decisions, "bfloat16 activations fall back to float32")
                return None
            _calibration_unused(calibration, decisions, "its scales are for int8 activations")
            return self._bf16_part
        missing = missing_features(INT8_FEATURES)
        if missing:
            decisions.record("activation_dtype", "float32",
                             f"activation_dtype={activation_dtype} but this CPU lacks "
                             f"{', '.join(missing)}; computing with float32 activations (exact)",
                             warn=activation_dtype != "auto")
            _calibration_unused(calibration, decisions, f"this CPU lacks {', '.join(missing)}")
            return None
        self.int8 = True
        return self._int8_part

    def _bf16_part(self, name: str, w: Matrix) -> Matrix:
        if isinstance(w, WeightMatrix) and w.dtype == "bfloat16":
            w, choice, why = (Bf16Matrix.pack(w), "bfloat16",
                              "bfloat16 weights: vdpbf16ps on activations rounded to bf16")
        else:
            choice, why = "float32", (f"{w.dtype} weights: bfloat16 activations are used with bfloat16 "
                                      "weights only")
        self.decisions.record("activation_dtype", choice, why, subject=name)
        return w

    def _int8_part(self, name: str, w: Matrix) -> Matrix:
        """int8 activations where this CPU runs w's kernel, but where calibration says the error exceeds its
        bound."""
        calibration, static_scales = self.calibration, self.static_scales
        cal = calibration.matrices[name] if calibration is not None else None
        chosen, lacking = w, int8_kernel_lacks(w)
        if lacking is None:
            choice, why = "float32", f"{w.dtype} weights have no int8-activation kernel"
        elif lacking:
            choice, why = "float32", (f"{w.dtype} weights: their int8 kernel needs {', '.join(lacking)}, "
                                      "which this CPU lacks; float32 activations (exact)")
        elif cal is not None and _falls_back(cal, calibration.bound, static_scales):
            error = cal.error_static if static_scales else cal.error_dynamic
            choice, why = "float32", (f"calibration ({calibration.path or 'not from a file'}): relative int8 "
                                      f"error {error:.3g} with "
                                      f"{'static' if static_scales else 'dynamic'} scales exceeds the bound "
                                      f"{calibration.bound:g}")
            self.fallbacks.append(name)
        else:
            scale = cal.scale if static_scales and cal is not None else 0.0
            chosen = pack_int8(w, scale)
            choice, why = "int8", (f"{w.dtype} weights, " + (
                f"static activation scale {scale:.4g} ({calibration.method}-calibrated)" if scale
                else "dynamic per-block activation scales"))
        self.decisions.record("activation_dtype", choice, why, subject=name)
        return chosen


def record_kernels(weights: ModelWeights, decisions: DecisionLog) -> None:
    """One "kernel" decision per layer type (qkv, o, gate_up, down, lm_head): the linear kernel, weight and
    activation dtypes its matrices run with, and in how many of the layers (models/linear.py)."""
    by_type: dict[str, Counter] = {}
    for _, key, matrix in linear_matrices(weights):
        by_type.setdefault(key, Counter())[" | ".join(_kernel(w) for w in parts(matrix))] += 1
    for key, paths in by_type.items():
        total = sum(paths.values())
        (choice, num), *others = paths.most_common()
        where = "the LM head" if key == "lm_head" else f"{num} of {total} layers"
        reason = where + "".join(f"; {n} of {total} layers: {p}" for p, n in others)
        exact = "float32 activations" in choice
        if any(("float32 activations" in p) != exact for p, _ in others):  # some fell back, or all but some
            reason += " (per-matrix fallbacks: see activation_dtype)"
        decisions.record("kernel", choice, reason, subject=key)


def int8_kernel_lacks(w: Matrix) -> tuple[str, ...] | None:
    """None where w's format has no int8-activation kernel; else the CPU features that kernel needs and this
    host lacks (empty: it runs here)."""
    if not isinstance(w, WeightMatrix) or w.dtype not in INT8_DTYPES:
        return None
    return missing_features(BlockInt8Matrix.features(w.dtype) if w.dtype in BLOCK_DTYPES else INT8_FEATURES)


def pack_int8(w: WeightMatrix, activation_scale: float = 0.0) -> Int8Matrix | BlockInt8Matrix:
    """w repacked for its int8-activation kernel."""
    pack = BlockInt8Matrix.pack if w.dtype in BLOCK_DTYPES else Int8Matrix.pack
    return pack(w, activation_scale)


def for_activations(w: WeightMatrix, activation_dtype: str) -> Matrix:
    """One matrix outside a model's layers (a draft head's): repacked for int8 activations where
    plan_activations would repack it without a calibration file, else unchanged."""
    if activation_dtype in ("int8", "auto") and int8_kernel_lacks(w) == ():
        return pack_int8(w)
    return w


def _kernel(w: Matrix) -> str:
    """The linear kernel a (part of a) matrix runs with, and its weight and activation dtypes."""
    if isinstance(w, BlockInt8Matrix):
        kernel = ("matmul_q6k" if w.dtype == "q6_k" else "matmul_kquant") + ("" if w.vnni else "_avx2")
        return f"{kernel}: {w.dtype} weights x int8 activations"
    if isinstance(w, Int8Matrix):
        return f"{'matmul_vnni' if w.vnni else 'matmul_int8'}: {w.dtype} weights x int8 activations"
    if isinstance(w, Bf16Matrix):
        return "matmul_bf16: bfloat16 weights x bfloat16 activations"
    return f"matmul: {w.dtype} weights x float32 activations"


def _falls_back(cal: MatrixCalibration, bound: float, static_scales: bool) -> bool:
    if not static_scales:
        return cal.fallback
    return cal.error_static is not None and cal.error_static > bound


def _calibration_unused(calibration: Calibration | None, decisions: DecisionLog, why: str) -> None:
    if calibration is not None:
        decisions.record("calibration", "unused", f"{calibration.path}: not needed ({why})")
