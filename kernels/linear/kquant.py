"""y = x @ W.T with x quantized to int8 (kernels/formats/int8_layout.py) and Q4_K / Q5_K / Q4_1 / Q5_0 /
Q5_1 / IQ4_NL / IQ4_XS weights packed by kernels/formats/kquant_layout.py, through the VNNI register block
of kernels/simd/kquant.py.

The drivers are matmul_vnni's and matmul_vnni_experts' (kernels/linear/int8.py): a task owns a block of 4
output rows and walks a chunk of tokens 4 at a time (then 2, then 1) while the chunk of x stays in L2.
qtype (the GGML type id, kernels/formats/ggml_blocks.py's CODE) picks the format's code per task, as
matmul_vnni's bits: one compiled function serves all seven. (numba.literally(qtype), one compilation per
format, was slow at every call: numba retypes the call through an exception every time.)

With the weights in cache, the K-quants' scales and Q5_K's fifth bits cost instructions beside q4_0; from
memory every format streams at least q4_0's bytes per second (benchmarks/results/HISTORY.md).
"""

from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.ggml_blocks import IQ4_NL, IQ4_XS, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K
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
    if (qtype != Q4_K and qtype != Q5_K and qtype != Q4_1 and qtype != Q5_0 and qtype != Q5_1
            and qtype != IQ4_NL and qtype != IQ4_XS):
        raise ValueError("qtype is not one of Q4_K, Q5_K, Q4_1, Q5_0, Q5_1, IQ4_NL, IQ4_XS")


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
    elif qtype == IQ4_NL:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, IQ4_NL)
    elif qtype == IQ4_XS:
        _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, IQ4_XS)


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
