"""Float rows to GGML's block bytes, as llama.cpp quantizes them, with or without an importance matrix: the
one dispatch over the quantizers (kernels/formats/quant_k.py, quant_iq4.py, quant_weighted.py, the gguf
package's reference rounding). memory/matrices.py's WeightMatrix.from_float calls it."""

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GT

from kernels.formats.ggml_blocks import CODE, GGML_TYPE, IQ4_DTYPES, K_QUANT_DTYPES
from kernels.formats.quant_iq4 import quantize_iq4
from kernels.formats.quant_k import quantize_k
from kernels.formats.quant_weighted import quantize_weighted_32


def quantize_blocks(w: np.ndarray, dtype: str, importance: np.ndarray | None) -> np.ndarray:
    """w: f32 [N, K] (whole blocks of the format) -> uint8 [N, row bytes] in dtype: a K-quant, an IQ4, q4_1,
    q5_0, q5_1, or q4_0 with an importance (f32 [G, K], G dividing N; without one q4_0 is quantize_q4_0's)."""
    n, k = w.shape
    kind = GT.Q4_0 if dtype == "q4_0" else GGML_TYPE[dtype]
    out = np.empty((n, gguf.quant_shape_to_byte_shape((k,), kind)[0]), np.uint8)
    if dtype in K_QUANT_DTYPES + IQ4_DTYPES:  # their kernels take [0, K] for no importance
        quantize = quantize_k if dtype in K_QUANT_DTYPES else quantize_iq4
        quantize(CODE[dtype], w, np.empty((0, k), np.float32) if importance is None else importance, out)
    elif importance is not None:
        quantize_weighted_32(int(kind), w, importance, out)
    else:
        # q4_1, q5_0, q5_1: the gguf package's, ggml's reference rounding (tests/kernels/
        # test_kquant_quantize.py). Fast enough in numpy: the K-quants, whose scale search is the cost, take
        # far longer
        out = gguf.quants.quantize(w, kind)
    return out
