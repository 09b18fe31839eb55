"""`numaserve calibrate`: run a model over text with float32 activations and write its calibration file
(or, with --imatrix, its importance matrix: compute_imatrix).

Three passes over the same token windows, each watching every linear layer's input through
`DecoderModel.observer`: (1) the largest |x|, (2) the histogram of |x| (percentile and kl only), then the
static scales (models/quantization/activation_ranges.py), (3) per matrix, the output with int8 activations
(dynamic per-block scales, and the static scale) against float32 activations with the same weights: error =
||Y_int8 - Y_f32|| / ||Y_f32|| over every calibration token. A matrix whose dynamic error exceeds the bound
falls back to float32 activations (models/quantization/activation_plan.py). A fourth pass over the first
windows measures each layer's attention output under each KV dtype (models/quantization/kv_calibration.py) and
recommends the layers to keep wider than the target KV dtype.
"""

import dataclasses
import hashlib
from pathlib import Path

import numpy as np

from cluster_configs.errors import CheckpointError
from kernels.attention.hadamard import is_power_of_two
from memory.kv_cache import KVCache
from memory.kv_formats import KV_FORMATS
from memory.matrices import Int8Matrix, WeightMatrix
from memory.weights import ModelWeights
from models.batch import ForwardBatch
from models.decoder import DecoderModel
from models.linear import linear
from models.loader import load_model
from models.quantization.activation_plan import linear_matrices
from models.quantization.activation_ranges import RangeStats, static_scale
from models.quantization.calibration import (
    Calibration,
    CalibrationError,
    CalibrationOptions,
    KVCalibration,
    MatrixCalibration,
    matrix_names,
)
from models.quantization.imatrix import ImatrixCollector, ImportanceMatrix, imatrix_chunks
from models.quantization.kv_calibration import REFERENCE, KVErrorMeter, wider_overrides

WINDOW_TOKENS = 256  # the demo family's training context
NUM_WINDOWS = 32  # 8,192 tokens: more move the scales and errors little (benchmarks/results/HISTORY.md)
NUM_KV_WINDOWS = 8  # of those, for the KV errors: each layer's attention seven times a window
IMATRIX_CHUNK_TOKENS = 512  # llama-imatrix's default context
_BLOCK = 16


def read_text_file(path: str | Path) -> str:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise CalibrationError(f"--text {path}: cannot be read ({e}); "
                               "pass a readable UTF-8 text file") from None
    if not text.strip():
        raise CalibrationError(f"--text {path}: the file is empty; pass text like what the model will serve "
                               "(a few thousand tokens or more)")
    return text


def token_windows(token_stream: np.ndarray, window_tokens: int, num_windows: int) -> list[np.ndarray]:
    """Evenly spaced, non-overlapping windows of a token stream (a short stream: one window of it all)."""
    num_chunks = len(token_stream) // window_tokens
    if num_chunks == 0:
        return [token_stream]
    starts = np.linspace(0, num_chunks - 1, min(num_windows, num_chunks)).astype(np.int64) * window_tokens
    return [token_stream[s:s + window_tokens] for s in starts]


def calibrate(model_path: str | Path, texts: list[str], text_label: str,
              options: CalibrationOptions | None = None) -> Calibration:
    """Texts are tokenized one by one (each as the tokenizer frames it, then EOS) into one stream."""
    options = options or CalibrationOptions()
    if not any(text.strip() for text in texts):
        raise CalibrationError(f"{text_label}: no text to calibrate on; "
                               "pass text like what the model will serve")
    model_path = _existing(model_path)
    weight_dtype = options.weight_dtype
    if weight_dtype == "auto" and model_path.suffix != ".gguf":
        weight_dtype = "q8_0"  # int8 activations run with q8_0 / q4_0 weights only
    spec, weights, tokenizer = load_model(model_path, weight_dtype)
    if spec.num_experts:
        raise CalibrationError(f"{model_path}: calibration of mixture-of-experts models is not supported; "
                               "their int8 activations use dynamic per-block scales, which need none")
    if tokenizer is None:
        raise CheckpointError(f"{model_path}: has no tokenizer; calibration needs one to tokenize the text")
    stream = tokenizer.stream(texts, _eos(spec))
    if len(stream) < 2:
        raise CalibrationError(f"{text_label}: {len(stream)} token(s); calibration needs some text")
    windows = token_windows(stream, min(WINDOW_TOKENS, spec.max_position_embeddings), NUM_WINDOWS)
    runner = WindowRunner(spec, weights)
    stats = {name: RangeStats() for name in matrix_names(spec.num_layers)}
    runner.run(windows, lambda name, x: stats[name].add_absmax(x))
    if options.method != "minmax":
        runner.run(windows, lambda name, x: stats[name].add_histogram(x))
    scales = {name: static_scale(s, options.method, options.percentile) for name, s in stats.items()}
    errors = _ErrorMeter(runner.matrices, scales)
    runner.run(windows, errors.observe)
    kv = _calibrate_kv(runner, windows[:NUM_KV_WINDOWS], options.kv_dtype)
    matrices = {}
    for name, s in stats.items():
        err_dynamic, err_static = errors.relative_errors(name)
        matrices[name] = MatrixCalibration(absmax=s.absmax, scale=scales[name], error_dynamic=err_dynamic,
                                           error_static=err_static,
                                           fallback=err_dynamic is not None and err_dynamic > options.bound)
    return Calibration(method=options.method, percentile=options.percentile if options.method == "percentile"
                       else None, bound=options.bound, weight_dtype=runner.model.weight_dtype,
                       text=text_label, text_sha256=hashlib.sha256("\0".join(texts).encode()).hexdigest(),
                       num_tokens=sum(len(w) for w in windows), num_layers=spec.num_layers, matrices=matrices,
                       kv=kv)


def _calibrate_kv(runner: "WindowRunner", windows: list[np.ndarray], target: str) -> KVCalibration:
    head_dim = runner.model.spec.head_dim
    kv_dtypes = [d for d, f in KV_FORMATS.items()
                 if d not in ("float32", REFERENCE) and (not f.rotated or is_power_of_two(head_dim))]
    if target not in kv_dtypes:
        raise CalibrationError(f'--kv-dtype "{target}": not a reduced KV dtype this model can store '
                               f"(head_dim {head_dim}); pick one of {', '.join(kv_dtypes)}")
    meter = KVErrorMeter(runner.model, runner.matrices, kv_dtypes)
    runner.run(windows, meter.observe)
    errors = meter.relative_errors()
    return KVCalibration(kv_dtype=target, num_tokens=sum(len(w) for w in windows), errors=errors,
                         kv_dtype_overrides=wider_overrides(errors, target, head_dim))


def _existing(model_path: str | Path) -> Path:
    model_path = Path(model_path)
    if not model_path.exists():
        raise CheckpointError(f"{model_path}: no such file or directory; pass a model directory "
                              "(config.json and safetensors) or a .gguf file")
    return model_path


def _eos(spec) -> int | None:
    return spec.eos_token_ids[0] if spec.eos_token_ids else None


def compute_imatrix(model_path: str | Path, texts: list[str], text_label: str, chunk_size: int | None = None,
                    process_output: bool = False, weight_dtype: str = "auto") -> ImportanceMatrix:
    """The model's importance matrix over the texts, as llama-imatrix computes it (models/quantization/
    imatrix.py): one text is tokenized whole as the tokenizer frames it (llama-imatrix's -f FILE), several
    (the held-out set) each framed and followed by EOS into one stream; chunks of chunk_size tokens (default
    llama-imatrix's 512, at most the model's context), each from position 0 with BOS first where the tokenizer
    adds one. weight_dtype "auto": float32 weights for a directory (a GGUF keeps its types); a float32 KV
    cache. process_output: the LM head's input too (llama-imatrix --process-output; an untied head only)."""
    model_path = _existing(model_path)
    if weight_dtype == "auto" and model_path.suffix != ".gguf":
        weight_dtype = "float32"
    spec, weights, tokenizer = load_model(model_path, weight_dtype)
    if tokenizer is None:
        raise CheckpointError(f"{model_path}: has no tokenizer; an importance matrix needs one to tokenize "
                              "the text")
    chunk_size = chunk_size or min(IMATRIX_CHUNK_TOKENS, spec.max_position_embeddings)
    if not 1 <= chunk_size <= spec.max_position_embeddings:
        raise CalibrationError(f"--chunk {chunk_size}: pass a chunk of 1 to {spec.max_position_embeddings} "
                               "tokens (the model's context)")
    stream = tokenizer.stream(texts, None if len(texts) == 1 else _eos(spec))
    chunks = imatrix_chunks(stream, chunk_size, spec.bos_token_id if tokenizer.frames[0] else None)
    if not chunks:
        raise CalibrationError(f"{text_label}: {len(stream)} tokens, fewer than one chunk of {chunk_size}; "
                               "pass more text (llama-imatrix asks for at least two chunks) or a smaller "
                               "--chunk")
    collector = ImatrixCollector(spec, process_output)
    WindowRunner(spec, weights, chunk_size).run(chunks, collector.observe)
    return collector.result((text_label,), len(chunks), chunk_size)


class WindowRunner:
    """The model over one window of tokens at a time (positions from 0), logits at every position."""

    def __init__(self, spec, weights: ModelWeights, max_tokens: int = WINDOW_TOKENS):
        self.model = DecoderModel(spec, weights)
        self.matrices = {name: w for name, _, w in linear_matrices(weights)}
        self.max_tokens = min(max_tokens, spec.max_position_embeddings)
        num_blocks = -(-self.max_tokens // _BLOCK)
        self.kv = KVCache(spec.num_layers, num_blocks, _BLOCK, spec.num_kv_heads, spec.head_dim, "float32")
        self.block_tables = np.arange(num_blocks, dtype=np.int32)[None]  # [1, num_blocks]

    def forward(self, token_ids: np.ndarray) -> np.ndarray:
        # token_ids: [T] -> logits [T, vocab]
        n = len(token_ids)
        positions = np.arange(n, dtype=np.int32)
        batch = ForwardBatch(np.asarray(token_ids, np.int64), positions, np.zeros(n, np.int32),
                             positions.astype(np.int64), self.block_tables, np.arange(n, dtype=np.int64))
        return self.model.forward(batch, self.kv)

    def run(self, windows: list[np.ndarray], observer) -> None:
        self.model.observer = observer
        try:
            for window in windows:
                self.forward(window)
        finally:
            self.model.observer = None


class _ErrorMeter:
    """Squared output errors of int8 activations (dynamic, static) against float32, per matrix."""

    def __init__(self, matrices: dict, scales: dict[str, float]):
        self.matrices = matrices
        self.packed = {}  # name -> (dynamic, static) Int8Matrix sharing one packed copy of the weights
        for name, w in matrices.items():
            if isinstance(w, WeightMatrix) and w.dtype in ("q8_0", "q4_0"):
                dynamic = Int8Matrix.pack(w)
                self.packed[name] = (dynamic, dataclasses.replace(dynamic, activation_scale=scales[name]))
        self.sums = {name: np.zeros(3) for name in self.packed}  # ||Y||^2, ||dY_dynamic||^2, ||dY_static||^2

    def observe(self, name: str, x: np.ndarray) -> None:
        if name not in self.packed:
            return
        ref = linear(x, self.matrices[name]).astype(np.float64)
        dynamic, static = self.packed[name]
        sums = self.sums[name]
        sums[0] += np.sum(ref * ref)
        sums[1] += np.sum((linear(x, dynamic) - ref) ** 2)
        sums[2] += np.sum((linear(x, static) - ref) ** 2) if static.activation_scale > 0 else 0.0

    def relative_errors(self, name: str) -> tuple[float | None, float | None]:
        if name not in self.sums:
            return None, None
        ref, d_dynamic, d_static = self.sums[name]
        if ref == 0:
            return 0.0, 0.0
        return float(np.sqrt(d_dynamic / ref)), float(np.sqrt(d_static / ref))
