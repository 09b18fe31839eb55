"""y = x @ W.T with x quantized to int8 (kernels/formats/int8_layout.py) and Q4_K / Q5_K / Q4_1 / Q5_0 / Q5_1
weights packed by kernels/formats/kquant_layout.py, through the VNNI register block of kernels/simd/kquant.py.

The drivers are matmul_vnni's and matmul_vnni_experts' (kernels/linear/int8.py): a task owns a block of 4
output rows and walks a chunk of tokens 4 at a time (then 2, then 1) while the chunk of x stays in L2.
qtype (the GGML type id, kernels/formats/ggml_blocks.py's CODE) picks the format's code per task, as
matmul_vnni's bits: one compiled function serves all five. (numba.literally(qtype), one compilation per
format, cost 8 ms a call: numba retypes the call through an exception every time.)

Measured on 2 Zen 4 cores shared with other jobs (A/B alternating in one process, medians; the spread is
between runs), 5632 x 2048, ms: in cache, 1 token q4_0 (matmul_vnni) 0.15-0.21 (25th percentiles
0.13-0.18), Q4_K 0.17-0.18, Q5_K 0.22-0.25 (3 runs of 1000); 8 tokens q4_0 0.69-0.72, Q4_K 0.75-0.80,
Q5_K 0.88-0.95 (per byte within 7%); 32 tokens (25th percentiles, the medians were noise) q4_0 2.6, Q4_K
3.0-3.1, Q5_K 3.7-4.0: the K-quants' scales and Q5_K's fifth bits cost instructions once the weights are
in cache. From memory, 20 such matrices per pass at 1 token: in each run the K-quant and legacy formats
stream at least q4_0's bytes per second (q4_0 8.8-13.9 GB/s, Q4_K 9.5-15.9, Q5_K 10.6-15.5; the
machine's load set the level).
"""

from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.ggml_blocks import Q4_1, Q4_K, Q5_0, Q5_1, Q5_K
from kernels.linear.int8 import X_CHUNK_BYTES
from kernels.moe.expert_tasks import expert_num_tasks, expert_task
from kernels.simd.kquant import kquant_block
from kernels.simd.vnni import ROWS


@njit(cache=True, nogil=True, parallel=True)
def matmul_kquant(xq, xd, xsum, data, out, qtype):
    # xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32], data: uint8 [N4, ...] (kquant_layout.pack_kquant
    # of format qtype), out: [T, N] f32
    _check_format(qtype)
    T, Kp = xq.shape
    chunk = max(4, X_CHUNK_BYTES // Kp // 4 * 4)
    for c0 in range(0, T, chunk):
        c1 = min(T, c0 + chunk)
        for task in prange(data.shape[0] // ROWS):
            _by_format(xq, xd, xsum, data, out, task * ROWS, c0, c1, qtype)


@njit(inline="always", nogil=True)
def _check_format(qtype):
    if qtype != Q4_K and qtype != Q5_K and qtype != Q4_1 and qtype != Q5_0 and qtype != Q5_1:
        raise ValueError("qtype is not one of Q4_K, Q5_K, Q4_1, Q5_0, Q5_1")


@njit(inline="always", nogil=True)
def _by_format(xq, xd, xsum, data, out, n, c0, c1, qtype):
    # qtype as a literal (the globals are constants): each branch compiles its format's block
    if qtype == Q4_K:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q4_K)
    elif qtype == Q5_K:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_K)
    elif qtype == Q4_1:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q4_1)
    elif qtype == Q5_0:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_0)
    elif qtype == Q5_1:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_1)


def _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, qtype):
    raise NotImplementedError("numba-only")


@overload(_kquant_tokens, inline="always", prefer_literal=True)
def _kquant_tokens_impl(xq, xd, xsum, data, out, n, c0, c1, qtype):
    if not isinstance(qtype, types.IntegerLiteral):
        return None
    q = qtype.literal_value

    def impl(xq, xd, xsum, data, out, n, c0, c1, qtype):
        t = c0
        while t + 4 <= c1:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 4)
            t += 4
        if c1 - t >= 2:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 2)
            t += 2
        if c1 - t == 1:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 1)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_kquant_experts(xq, xd, xsum, data, out, qtype, experts, starts):
    # Several experts' matmul_kquant in one parallel region (kernels/moe/expert_tasks.py: the layout of data,
    # experts, starts; the tasks); out: [R, N] f32
    _check_format(qtype)
    N = out.shape[1]
    for task in prange(expert_num_tasks(experts.shape[0], N, ROWS)):
        e, r0, r1, b0, b1 = expert_task(task, experts, starts, N, ROWS)
        d = data[e * N:(e + 1) * N]
        x, xs, xt, o = xq[r0:r1], xd[r0:r1], xsum[r0:r1], out[r0:r1]
        for b in range(b0, b1):
            _by_format(x, xs, xt, d, o, b * ROWS, 0, r1 - r0, qtype)
