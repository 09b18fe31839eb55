"""y = x @ W.T with x quantized to int8 (kernels/formats/int8_layout.py) and Q4_K / Q5_K / Q4_1 / Q5_0 /
Q5_1 / IQ4_NL / IQ4_XS weights packed by kernels/formats/kquant_layout.py, through the VNNI register block
of kernels/simd/kquant.py; matmul_kquant_avx2 the same block and bits without VNNI (vpdpbusd's integers
through vpmaddubsw and vpmaddwd: kernels/simd/vnni.py dpbusd_avx2), for all but the IQ4 formats (their
levels + 128 would saturate vpmaddubsw's int16 pairs).

The drivers are matmul_vnni's and matmul_vnni_experts' (kernels/linear/int8.py): a task owns a block of 4
output rows and walks a chunk of tokens while the chunk of x stays in L2; with VNNI the tokens in pairs 6 at
a time through the 512-bit block (kernels/simd/kquant_wide.py), then 4 or 2, a last odd one through the
256-bit block; without, 4 at a time (then 2, then 1).
qtype (the GGML type id, kernels/formats/ggml_blocks.py's CODE) picks the format's code per task, as
matmul_vnni's bits: one compiled function serves all seven. (numba.literally(qtype), one compilation per
format, was slow at every call: numba retypes the call through an exception every time.)

With the weights in cache, the K-quants' scales and Q5_K's fifth bits cost instructions beside q4_0; from
memory every format streams at least q4_0's bytes per second (benchmarks/results/HISTORY.md).
"""

from gguf import GGMLQuantizationType as QT
from numba import njit, prange, types
from numba.extending import overload

from kernels.formats.ggml_blocks import IQ4_NL, IQ4_XS, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K
from kernels.formats.kquant_layout import FORMATS
from kernels.formats.token_pairs import PAIR_BLOCK_TOKENS, pair_tokens, whole_batch
from kernels.linear.chunking import token_chunk
from kernels.moe.expert_tasks import expert_num_tasks, expert_task
from kernels.simd.kquant import AVX2_FORMATS, kquant_block
from kernels.simd.kquant_wide import kquant_block_wide
from kernels.simd.vnni import ROWS


@njit(cache=True, nogil=True, parallel=True)
def matmul_kquant(xq, xd, xsum, data, out, qtype, x_chunk_bytes):
    # xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32], data: uint8 [N4, ...] (kquant_layout.pack_kquant
    # of format qtype), out: [T, N] f32; x_chunk_bytes: kernels/linear/chunking.py
    _matmul(xq, xd, xsum, data, out, qtype, 1, x_chunk_bytes)


@njit(cache=True, nogil=True, parallel=True)
def matmul_kquant_avx2(xq, xd, xsum, data, out, qtype, x_chunk_bytes):
    # matmul_kquant's operands and bits without VNNI (kernels/simd/vnni.py dpbusd_avx2), for the formats of
    # AVX2_FORMATS (not IQ4_NL, IQ4_XS)
    _matmul(xq, xd, xsum, data, out, qtype, 0, x_chunk_bytes)


def _matmul(xq, xd, xsum, data, out, qtype, vnni, x_chunk_bytes):
    raise NotImplementedError("numba-only")


@overload(_matmul, inline="always", prefer_literal=True)
def _matmul_impl(xq, xd, xsum, data, out, qtype, vnni, x_chunk_bytes):
    if not isinstance(vnni, types.IntegerLiteral):
        return None
    v = vnni.literal_value

    def impl(xq, xd, xsum, data, out, qtype, vnni, x_chunk_bytes):
        _check_format(qtype, v)
        T, Kp = xq.shape
        if v and T > 1:  # the 512-bit block's pairs (one token is its own pairing)
            xq, xd, xsum = pair_tokens(xq, xd, xsum, whole_batch(T))
        chunk = token_chunk(Kp, PAIR_BLOCK_TOKENS if v else 4, x_chunk_bytes)
        for c0 in range(0, T, chunk):
            c1 = min(T, c0 + chunk)
            for task in prange(data.shape[0] // ROWS):
                _by_format(xq, xd, xsum, data, out, task * ROWS, c0, c1, qtype, v)
    return impl


def _check_format(qtype, vnni):
    raise NotImplementedError("numba-only")


@overload(_check_format, inline="always", prefer_literal=True)
def _check_format_impl(qtype, vnni):
    # the formats a block compiles for: kquant_layout.FORMATS with VNNI, kernels/simd/kquant.py's AVX2_FORMATS
    # without
    if not isinstance(vnni, types.IntegerLiteral):
        return None
    formats = FORMATS if vnni.literal_value else AVX2_FORMATS
    codes = tuple(sorted(formats))
    message = ("qtype is not one of " + ", ".join(QT(c).name for c in codes)
               + ("" if vnni.literal_value else " (the AVX2 kernel's formats)"))

    def impl(qtype, vnni):
        for code in codes:
            if qtype == code:
                return
        raise ValueError(message)
    return impl


def _by_format(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
    raise NotImplementedError("numba-only")


@overload(_by_format, inline="always", prefer_literal=True)
def _by_format_impl(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
    # qtype as a literal (the globals are constants): each branch compiles its format's block
    if not isinstance(vnni, types.IntegerLiteral):
        return None
    v = vnni.literal_value

    def impl(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
        if qtype == Q4_K:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q4_K, v)
        elif qtype == Q5_K:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_K, v)
        elif qtype == Q4_1:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q4_1, v)
        elif qtype == Q5_0:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_0, v)
        elif qtype == Q5_1:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, Q5_1, v)
        elif qtype == IQ4_NL:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, IQ4_NL, v)
        elif qtype == IQ4_XS:
            _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, IQ4_XS, v)
    return impl


def _kquant_tokens(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
    raise NotImplementedError("numba-only")


@overload(_kquant_tokens, inline="always", prefer_literal=True)
def _kquant_tokens_impl(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, vnni)):
        return None
    q, v = qtype.literal_value, vnni.literal_value
    if not v and q not in AVX2_FORMATS:  # IQ4 without VNNI: no block compiles; _check_format refused it
        return lambda xq, xd, xsum, data, out, n, c0, c1, qtype, vnni: None

    if v:
        def paired(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
            # xq, xd, xsum paired from row c0 (even from the segment's start)
            t = c0
            while t + PAIR_BLOCK_TOKENS <= c1:
                kquant_block_wide(xq, xd, xsum, data, out, t, n, q, 3)
                t += PAIR_BLOCK_TOKENS
            if c1 - t >= 4:
                kquant_block_wide(xq, xd, xsum, data, out, t, n, q, 2)
                t += 4
            elif c1 - t >= 2:
                kquant_block_wide(xq, xd, xsum, data, out, t, n, q, 1)
                t += 2
            if c1 - t == 1:  # a segment's odd last row, as it was
                kquant_block(xq, xd, xsum, data, out, t, n, q, 1, 1)
        return paired

    def impl(xq, xd, xsum, data, out, n, c0, c1, qtype, vnni):
        t = c0
        while t + 4 <= c1:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 4, v)
            t += 4
        if c1 - t >= 2:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 2, v)
            t += 2
        if c1 - t == 1:
            kquant_block(xq, xd, xsum, data, out, t, n, q, 1, v)
    return impl


@njit(cache=True, nogil=True, parallel=True)
def matmul_kquant_experts(xq, xd, xsum, data, out, qtype, experts, starts):
    # Several experts' matmul_kquant in one parallel region (kernels/moe/expert_tasks.py: the layout of data,
    # experts, starts; the tasks); out: [R, N] f32
    _check_format(qtype, 1)
    N = out.shape[1]
    if xq.shape[0] > 1:
        xq, xd, xsum = pair_tokens(xq, xd, xsum, starts)
    for task in prange(expert_num_tasks(experts.shape[0], N, ROWS)):
        e, r0, r1, b0, b1 = expert_task(task, experts, starts, N, ROWS)
        d = data[e * N:(e + 1) * N]
        x, xs, xt, o = xq[r0:r1], xd[r0:r1], xsum[r0:r1], out[r0:r1]
        for b in range(b0, b1):
            _by_format(x, xs, xt, d, o, b * ROWS, 0, r1 - r0, qtype, 1)
