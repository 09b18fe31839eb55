"""The normalized Walsh-Hadamard transform of each head's vector, in place.

H = (Sylvester's Hadamard matrix of order D) / sqrt(D) is symmetric and orthonormal, so H is its own
inverse and (H q) . (H k) = q . k: rotating queries and keys leaves scores unchanged in exact arithmetic,
and sum_j p_j (H v_j) = H (sum_j p_j v_j), so rotated values give H times the attention output. The
rotation spreads a few large coordinates (outliers) over all D before a row is quantized with one scale.
"""

import numpy as np
from numba import njit


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@njit(cache=True, nogil=True)
def hadamard_inplace(x):
    # x: [N, H, D] float32, D a power of two (any strides: q, k, v are views of the fused qkv output)
    D = x.shape[2]
    norm = np.float32(1.0 / np.sqrt(D))
    for n in range(x.shape[0]):
        for h in range(x.shape[1]):
            step = 1
            while step < D:  # butterflies of width 2 * step: (a, b) -> (a + b, a - b)
                for i in range(0, D, 2 * step):
                    for j in range(i, i + step):
                        a, b = x[n, h, j], x[n, h, j + step]
                        x[n, h, j] = a + b
                        x[n, h, j + step] = a - b
                step *= 2
            for d in range(D):
                x[n, h, d] *= norm
