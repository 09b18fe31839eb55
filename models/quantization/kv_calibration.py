"""Per-layer KV precision from the calibration text: each layer's attention output with its keys and values
stored in each KV dtype, against bfloat16 KV, on the same queries, keys and values (those of the float32
forward), and which layers to keep wider for a target dtype.

error[dtype][layer] = ||O_dtype - O_bf16|| / ||O_bf16|| over every calibration token, O the attention output
[T, n_heads, D] of one window (positions from 0) before the output projection. A layer's error measures only
its own KV rounding, not what earlier layers passed on.
"""

import re

import numpy as np

from memory.kv_formats import KV_FORMATS, attend_as, write_kv_as
from models.decoder import DecoderModel
from models.linear import linear

REFERENCE = "bfloat16"
# a layer whose error under the target is more than this many times the median layer's is kept wider: above
# the spread of the demo model's and a tiny random model's layers, reached by a layer made an outlier by
# scaling up its k_proj (benchmarks/results/HISTORY.md)
OUTLIER_FACTOR = 2.0
_BLOCK = 16
_QKV = re.compile(r"layers\.(\d+)\.qkv")


class KVErrorMeter:
    """A calibration observer: at each layer's qkv input, that layer's attention in every KV dtype."""

    def __init__(self, model: DecoderModel, matrices: dict, kv_dtypes: list[str]):
        self.model, self.matrices, self.kv_dtypes = model, matrices, kv_dtypes
        num_layers = model.spec.num_layers
        self.sums = {d: np.zeros(num_layers) for d in [REFERENCE, *kv_dtypes]}  # ||O_bf16||^2, ||dO||^2

    def observe(self, name: str, x: np.ndarray) -> None:
        match = _QKV.fullmatch(name)
        if match is None:
            return
        i = int(match.group(1))
        qkv = linear(x, self.matrices[name])
        bias = self.model.weights.layers[i].qkv_bias
        if bias is not None:
            qkv += bias
        q, k, v = self.model.attention_inputs(i, qkv, np.arange(len(x), dtype=np.int32))
        ref = self._attend(REFERENCE, i, q, k, v).astype(np.float64)
        self.sums[REFERENCE][i] += np.sum(ref * ref)
        for d in self.kv_dtypes:
            self.sums[d][i] += np.sum((self._attend(d, i, q, k, v) - ref) ** 2)

    def _attend(self, kv_dtype: str, i: int, q, k, v) -> np.ndarray:
        # one sequence of T tokens on blocks 0, 1, ...: every token attends to its prefix
        spec, fmt = self.model.spec, KV_FORMATS[kv_dtype]
        T, D = len(q), spec.head_dim
        num_blocks = -(-T // _BLOCK)
        shape = (num_blocks, _BLOCK, spec.num_kv_heads)
        k_cache = np.zeros((*shape, fmt.row_elements(D)), fmt.storage)
        v_cache = np.zeros_like(k_cache)
        k_scale, v_scale = np.ones(shape, np.float32), np.ones(shape, np.float32)
        positions = np.arange(T, dtype=np.int32)
        write_kv_as(fmt, k.copy(), v.copy(), positions, k_cache, v_cache, k_scale, v_scale)  # rotates copies
        out = np.empty(q.shape, np.float32)
        block_table = np.arange(num_blocks, dtype=np.int32)[None]
        attend_as(fmt, q.copy(), k_cache, v_cache, k_scale, v_scale, block_table, np.zeros(T, np.int32),
                  positions, spec.layer_windows[i], spec.softmax_scale, out, softcap=spec.attn_softcap)
        return out

    def relative_errors(self) -> dict[str, list[float]]:
        ref = np.maximum(self.sums[REFERENCE], 1e-300)
        return {d: [float(e) for e in np.sqrt(self.sums[d] / ref)] for d in self.kv_dtypes}


def wider_overrides(errors: dict[str, list[float]], target: str, head_dim: int) -> dict[int, str]:
    """{layer: dtype} for the layers whose error under target exceeds OUTLIER_FACTOR x the median layer's:
    the dtype of fewest bytes, wider than target, whose error at that layer is within the median (bfloat16
    when none is)."""
    median = float(np.median(errors[target]))
    size = {d: KV_FORMATS[d].row_bytes(head_dim) for d in errors}
    overrides = {}
    for layer, error in enumerate(errors[target]):
        if error > OUTLIER_FACTOR * median:
            wider = sorted((size[d], errors[d][layer], d) for d in errors if size[d] > size[target])
            overrides[layer] = next((d for _, e, d in wider if e <= median), REFERENCE)
    return overrides
