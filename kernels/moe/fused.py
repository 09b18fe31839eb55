"""A mixture-of-experts layer's routed experts in one compiled call, for experts packed for the VNNI kernel
(q8_0 / q4_0 weights, int8 activations): the float32 router, top-k, grouping by expert, quantizing the
tokens, both projections of every routed expert, SiLU-gate and the weighted sum.

It runs the same kernels as the step by step path (models/linear.py's float32 matmul for the router,
kernels/moe/route.py, kernels/int8_layout.quantize_activations, kernels/norms.silu_mul, matmul_vnni_experts),
so a token gets the same bits, and the same bits in any batch. Two things differ, neither in the values: a
token's row is quantized once and its int8 row copied to each of its k pairs (the same row quantizes to the
same bytes), and each pair's expert output stays in the grouped order (the weighted sum reads it through
`position`).

Why one call: the step by step path ran everything but the two projections as ~15 kernel calls and ~20
allocations from Python (quantizing a token once per slot among them), and the whole layer measured faster
here at every batch size, so every step takes it. Each projection stays one parallel region
(matmul_vnni_experts' tasks of 32 rows of one expert): a region per expert doing gate_up, SiLU and the
quantizing, or the whole expert with down too (no region in between), measured no faster, and tasks of whole
experts would leave threads idle where the threads outnumber the routed experts.
"""

import numpy as np
from numba import njit

from kernels.formats.int8_layout import quantize_activations
from kernels.linear.dispatch import matmul
from kernels.linear.int8 import matmul_vnni_experts
from kernels.moe.route import active_experts, group_by_expert, route_tokens, weighted_sum
from kernels.norms import silu_mul

_NO_SCALES = np.zeros((1, 1), np.uint16)  # the router is float32: its matmul reads no scales


@njit(cache=True, nogil=True)
def moe_vnni(x, router, normalize, top_k, first, end, gate_up, gate_up_scales, gate_up_static,
             gate_up_bits, down, down_scales, down_static, down_bits, x_chunk_bytes, logits, ids, weights,
             offsets, slots, position, active, starts, token_q, token_d, token_sum, xq, xd, xsum, gate_up_out,
             act, aq, ad, asum, y, out):
    # x: [T, H] f32, router: [E, H] f32; [first, end): the experts held (all, or a rank's under expert
    # parallelism: the other pairs' outputs are zeros); gate_up / down (+ _scales): the held experts
    # stacked, packed for the VNNI kernel (Int8Matrix data / scales: end - first blocks of 2I rows | H rows),
    # *_static: their activation scales (0: dynamic), *_bits: 8 (q8_0) | 4 (q4_0), x_chunk_bytes: the router's
    # matmul's (kernels/linear/chunking.py). Buffers, leading dimension
    # at least T | R = T * top_k | E: logits [T, E] f32, ids [T, k] int32, weights [T, k] f32 (the routing:
    # written), offsets [E + 1], slots / position [R], active [E], starts [E + 1] int64; token_q / token_d /
    # token_sum: x quantized [T, Kp] int8, [T, Kp // 32] f32 / int32; xq / xd / xsum: [R, ...] the held
    # pairs' rows, grouped by expert; gate_up_out [R, 2I] f32; act [R, I] f32; aq / ad / asum: act quantized
    # [R, Ip] int8, [R, Ip // 32]; y [R, H] f32 (the pairs' expert outputs); out: [T, H] f32 the output.
    T = x.shape[0]
    R = T * top_k
    logits, ids, weights = logits[:T], ids[:T], weights[:T]
    matmul(x, router, _NO_SCALES, logits, x_chunk_bytes)
    route_tokens(logits, normalize, ids, weights)
    group_by_expert(ids, offsets, slots[:R], position[:R])
    # the held experts' pairs are rows p0:p1 of the grouped order; their ids from 0, their starts from p0
    p0, p1 = offsets[first], offsets[end]
    S = active_experts(offsets[first:end + 1], active, starts)
    for s in range(S + 1):
        starts[s] -= p0
    active, starts = active[:S], starts[:S + 1]
    token_q, token_d, token_sum = token_q[:T], token_d[:T], token_sum[:T]
    quantize_activations(x, token_q, token_d, token_sum, gate_up_static)
    n = p1 - p0
    for p in range(n):  # held pair p0 + p's row: its token's
        t = slots[p0 + p] // top_k
        xq[p, :] = token_q[t, :]
        xd[p, :] = token_d[t, :]
        xsum[p, :] = token_sum[t, :]
    xq, xd, xsum, gate_up_out, act = xq[:n], xd[:n], xsum[:n], gate_up_out[:n], act[:n]
    matmul_vnni_experts(xq, xd, xsum, gate_up, gate_up_scales, gate_up_out, gate_up_bits, active, starts)
    silu_mul(gate_up_out, act)
    aq, ad, asum = aq[:n], ad[:n], asum[:n]
    quantize_activations(act, aq, ad, asum, down_static)
    y[:p0, :] = 0.0
    y[p1:R, :] = 0.0
    matmul_vnni_experts(aq, ad, asum, down, down_scales, y[p0:p1], down_bits, active, starts)
    weighted_sum(y, weights, position, out[:T])
