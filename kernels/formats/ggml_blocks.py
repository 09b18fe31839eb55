"""GGML block formats served as their GGUF bytes: the K-quants (q4_k, q5_k, q6_k: super-blocks of 256), the
legacy types with a 5th bit or a min (q4_1, q5_0, q5_1: blocks of 32) and the 4-bit non-linear I-quants
(iq4_nl: blocks of 32, iq4_xs: super-blocks of 256). The one table of their geometry.

A matrix in one of them is uint8 [N, K // block_size * type_size]: each row its blocks exactly as a GGUF file
stores them (no separate scales), so rows are sliced, gathered and mapped from a file as plain bytes.
Kernels tell the formats apart by an integer code, the GGML type id (CODE).
"""

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as GT

GGML_TYPE = {"q4_k": GT.Q4_K, "q5_k": GT.Q5_K, "q6_k": GT.Q6_K,
             "q4_1": GT.Q4_1, "q5_0": GT.Q5_0, "q5_1": GT.Q5_1, "iq4_nl": GT.IQ4_NL, "iq4_xs": GT.IQ4_XS}
BLOCK_DTYPES = tuple(GGML_TYPE)
K_QUANT_DTYPES = ("q4_k", "q5_k", "q6_k")
IQ4_DTYPES = ("iq4_nl", "iq4_xs")
CODE = {dtype: int(t) for dtype, t in GGML_TYPE.items()}
Q4_K, Q5_K, Q6_K, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS = (CODE[d] for d in BLOCK_DTYPES)  # for numba kernels
# bytes per block, as constants for the numba kernels (constant strides vectorize: a stride read from the
# row's length made dequantization several times slower)
(Q4_K_BYTES, Q5_K_BYTES, Q6_K_BYTES, Q4_1_BYTES, Q5_0_BYTES, Q5_1_BYTES, IQ4_NL_BYTES,
 IQ4_XS_BYTES) = (GGML_QUANT_SIZES[t][1] for t in GGML_TYPE.values())
QK_K = GGML_QUANT_SIZES[GT.Q4_K][0]  # values per K-quant super-block (256)


def row_bytes(dtype: str, k: int) -> int:
    """Bytes of a row of k values (k a multiple of the block size)."""
    size, type_size = GGML_QUANT_SIZES[GGML_TYPE[dtype]]
    if k % size:
        raise ValueError(f"{dtype} rows are whole blocks of {size} values, not {k}")
    return k // size * type_size


def row_values(dtype: str, nbytes: int) -> int:
    """Values in a row of nbytes bytes."""
    size, type_size = GGML_QUANT_SIZES[GGML_TYPE[dtype]]
    return nbytes // type_size * size
