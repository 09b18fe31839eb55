"""The low-rank LoRA path over a flat batch: out[t] += scaling_s * (x[t] @ A_s.T) @ B_s.T for row t's slot s.

Every adapter of a step sits in a slot (models/lora/slots.py) of one stacked buffer per layer and module,
and the batch's rows come grouped by adapter (scheduling/model_runner.py), so rows of any mix of
adapters run in one call (the SGMV shape), for all the modules that share an input at once (q, k, v;
gate, up): a shrink to each row's rank, register-blocked like the base linear (kernels/simd/block.py: an
A row is read once per 4 rows of its group), then an expand that adds each row's rank-r vector times B
into the base linear's output, parallel over blocks of output columns and register-blocked the same way
(kernels/simd/expand.py: a B^T slice is read once per 4 rows). A and B are float32, bf16 bits (half the
bytes to read) or q8_0 (34 bytes per 32 values: each row of A and of B^T in 32-column blocks with an fp16
scale, the base linear's q8_0 semantics; dimensions multiples of 32).

Every output sums in one order whatever the batch: the shrink's blocks sum alike for every block shape
(kernels/simd/block.py), the expand goes rank by rank, and the scaling comes last, as in PEFT's
lora_B(lora_A(x)) * scaling. So a row's delta does not depend on the rows it runs with.
"""

import numpy as np
from numba import njit, prange

from kernels.formats.bf16 import as_f32
from kernels.linear.dispatch import column_tail
from kernels.simd.block import LANES, matmul_block
from kernels.simd.expand import expand_block

_COLUMNS = 64  # output columns per expand task
_ROWS, _TOKENS = 4, 4  # shrink register block: A rows x rows of a group


@njit(cache=True, nogil=True, parallel=True)
def lora_shrink_expand(x, starts, ends, group_slots, a, a_scales, bt, bt_scales, ranks, scalings, col_offsets,
                       out):
    # x: [T, K] f32; group g: rows starts[g]:ends[g] ([G] int64 each), all of slot group_slots[g] ([G]
    # int32); per module m (tuples of M): a[m]: [S, R, K] f32 | uint16 bf16 | int8 q8_0,
    # bt[m]: [S, R, N_m] (B transposed), the same dtype; q8_0's fp16 scales a_scales[m]: [S, R, K // 32],
    # bt_scales[m]: [S, R, N_m // 32] uint16 (float formats: [S, 1, 1], unread); ranks[m]: [S] int32
    # (0: not adapted), scalings[m]: [S] f32; col_offsets: [M + 1] int64, module m's columns in out;
    # out: [T, N] f32 (+=). The tuples may run past M (models/lora/slots.py pads them to one length, so one
    # compile serves every fused projection): entries from M on are not read
    M, G = col_offsets.shape[0] - 1, group_slots.shape[0]
    R = a[0].shape[1]
    tmp = np.zeros((M, x.shape[0], R), np.float32)  # [M, T, R]: x @ A_s.T, up to each row's rank
    num_row_blocks = (R + _ROWS - 1) // _ROWS
    for task in prange(M * G * num_row_blocks):
        m, rest = task // (G * num_row_blocks), task % (G * num_row_blocks)
        g, j0 = rest // num_row_blocks, rest % num_row_blocks * _ROWS
        s = group_slots[g]
        r = ranks[m][s]
        if j0 >= r:
            continue
        a_s, a_scales_s, tmp_m = a[m][s], a_scales[m][s], tmp[m]
        t0, t1 = starts[g], ends[g]
        j1 = min(r, j0 + _ROWS)
        t = t0
        while t + _TOKENS <= t1:
            if j1 - j0 == _ROWS:
                matmul_block(x, a_s, a_scales_s, tmp_m, t, j0, _ROWS, _TOKENS)
            else:
                for j in range(j0, j1):
                    matmul_block(x, a_s, a_scales_s, tmp_m, t, j, 1, _TOKENS)
            t += _TOKENS
        for q in range(t, t1):
            for j in range(j0, j1):
                matmul_block(x, a_s, a_scales_s, tmp_m, q, j, 1, 1)
        column_tail(x, a_s, tmp_m, t0, t1, j0, j1)
    num_chunks = np.empty(M + 1, np.int64)  # expand tasks: module m's column blocks are chunks
    num_chunks[0] = 0
    for m in range(M):
        num_chunks[m + 1] = num_chunks[m] + (col_offsets[m + 1] - col_offsets[m] + _COLUMNS - 1) // _COLUMNS
    for task in prange(num_chunks[M]):
        m = 0
        while num_chunks[m + 1] <= task:
            m += 1
        n0 = (task - num_chunks[m]) * _COLUMNS
        n1 = min(col_offsets[m + 1] - col_offsets[m], n0 + _COLUMNS)
        vector_end = n0 + (n1 - n0) // LANES * LANES
        bt_m, bt_scales_m, tmp_m, c0 = bt[m], bt_scales[m], tmp[m], col_offsets[m]
        for g in range(G):
            s = group_slots[g]
            r = ranks[m][s]
            if r == 0:
                continue
            bt_s, bt_scales_s, scaling = bt_m[s], bt_scales_m[s], scalings[m][s]
            for n in range(n0, vector_end, LANES):
                t = starts[g]
                while t + _TOKENS <= ends[g]:
                    expand_block(tmp_m, bt_s, bt_scales_s, out, t, n, c0, r, scaling, _TOKENS)
                    t += _TOKENS
                for q in range(t, ends[g]):
                    expand_block(tmp_m, bt_s, bt_scales_s, out, q, n, c0, r, scaling, 1)
            for n in range(vector_end, n1):  # columns past the last whole vector (float formats only)
                for t in range(starts[g], ends[g]):
                    acc = np.float32(0.0)
                    for j in range(r):
                        acc += tmp_m[t, j] * as_f32(bt_s[j, n])
                    out[t, c0 + n] += scaling * acc
