"""How many tokens of x one pass over a matrix's weights takes, for every linear kernel: the chunk of x whose
rows fill half of a core's L2 (so it stays there while every row group of the weights passes over it), a
whole number of register blocks, at least one."""

from numba import njit

X_CHUNK_BYTES = 1 << 19  # half of a core's L2


@njit(inline="always", nogil=True)
def token_chunk(row_bytes, block_tokens):
    # row_bytes: a token's bytes of x as the kernel reads them -> tokens per pass, a multiple of block_tokens
    return max(block_tokens, X_CHUNK_BYTES // row_bytes // block_tokens * block_tokens)
