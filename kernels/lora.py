"""The low-rank LoRA path over a flat batch: out[t] += (x[t] @ A_s.T) @ B_s.T for the adapter slot s of row t.

Every adapter in a step sits in a slot (models/lora_slots.py) of one stacked buffer per layer and module,
so rows of any mix of adapters run in one call (the BGMV / SGMV shape): a shrink to each row's rank, then
an expand into the base linear's output. Both phases are parallel over independent dot products (the
shrink over rows x rank, the expand over blocks of output columns), so a single decoding row still uses
every thread. Every output sums in one fixed order (a fixed-order dot, kernels/simd_dot.py; the expand
rank by rank) over that row's own values: a row's delta does not depend on its batch. B is stored
transposed, [R, N] per slot, so a slot of rank r touches only its first r rows of A and of B^T.
"""

import numpy as np
from numba import njit, prange

from kernels.simd_dot import dot

_COLUMNS = 64  # output columns per expand task: one row of them stays in registers / L1


@njit(cache=True, nogil=True, parallel=True)
def lora_shrink_expand(x, row_slot, a, bt, ranks, scalings, out):
    # x: [T, K] f32; row_slot: [T] int32 (-1: no adapter); a: [S, R, K] f32; bt: [S, R, N] f32, B transposed;
    # ranks: [S] int32, each slot's rank for this module (0: not adapted); scalings: [S] f32;
    # out: [T, N] f32, += scaling * B (A x) for each row, scaled last as PEFT does
    T = x.shape[0]
    R, N = bt.shape[1], bt.shape[2]
    tmp = np.empty((T, R), np.float32)  # [T, R]: x @ A_s.T, up to each row's rank
    for i in prange(T * R):
        t, j = i // R, i % R
        s = row_slot[t]
        if s >= 0 and j < ranks[s]:
            tmp[t, j] = dot(x[t], a[s, j])
    for c in prange((N + _COLUMNS - 1) // _COLUMNS):
        n0 = c * _COLUMNS
        n1 = min(N, n0 + _COLUMNS)
        acc = np.empty(_COLUMNS, np.float32)
        for t in range(T):
            s = row_slot[t]
            if s < 0 or ranks[s] == 0:
                continue
            acc[:] = 0.0
            for j in range(ranks[s]):  # in rank order: a fixed sum per output
                w = tmp[t, j]
                for n in range(n0, n1):
                    acc[n - n0] += w * bt[s, j, n]
            scaling = scalings[s]
            for n in range(n0, n1):
                out[t, n] += scaling * acc[n - n0]
