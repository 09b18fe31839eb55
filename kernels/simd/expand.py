"""LoRA's expand as an LLVM IR register block: out[t, c0 + n0 : +16] += scaling * sum_j tmp[t, j] *
B^T[j, n0 : +16] for TB rows t at once.

TB accumulators of 16 float32 lanes stay in vector registers while the rank runs: each 16-wide slice of a
B^T row is loaded once (bf16: shift; q8_0: sign-extend, convert, times its 32-column block's scale) and
multiplied into every row with a fused multiply-add. An output
sums j = 0, 1, ... r - 1 in one FMA chain, then is scaled and added to out, whatever TB: a row's result
does not depend on the rows blocked with it (batch invariance). numba's loops kept the accumulators in
memory and ran several times slower (kernels/simd/block.py says the same of the base linear).

numba's on-disk cache of kernels/lora.py does not notice edits to this file: after changing the code
generation here, delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.block import _F32, _I64, LANES, _fma, _splat, _vector_load, widen_bf16

_VF32 = ir.VectorType(_F32, LANES)
_STORED = (types.float32, types.uint16, types.int8)  # float32, bf16 bits, q8_0 values


def _load_f32(builder, array_type, data, scales, N, j, n0):
    # <16 x float> of bt[j, n0:n0+16]
    offset = builder.add(builder.mul(j, N), n0)
    if array_type.dtype == types.float32:
        return _vector_load(builder, data, offset, _F32)
    if array_type.dtype == types.uint16:
        return widen_bf16(builder, _vector_load(builder, data, offset, ir.IntType(16)))
    q = builder.sext(_vector_load(builder, data, offset, ir.IntType(8)), ir.VectorType(ir.IntType(32), LANES))
    thirty_two = ir.Constant(_I64, 32)  # q8_0: one fp16 scale per 32 columns of a row, [R, N // 32]
    index = builder.add(builder.mul(j, builder.udiv(N, thirty_two)), builder.udiv(n0, thirty_two))
    bits = builder.load(builder.gep(scales, [index]))
    d = _splat(builder, builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32))
    return builder.fmul(builder.sitofp(q, _VF32), d)


@intrinsic(prefer_literal=True)
def expand_block(typingctx, tmp, bt, bt_scales, out, t0, n0, c0, rank, scaling, tokens):
    """out[t0:t0+TB, c0+n0:c0+n0+16] += scaling * tmp[t0:t0+TB, :rank] @ bt[:rank, n0:n0+16].

    tmp: [T, R] f32, bt: [R, N] f32 | uint16 bf16 | int8 q8_0 with bt_scales [R, N // 32] uint16 fp16 (read
    for q8_0 only; n0 a multiple of 16), out: [T, N_out] f32, all C-contiguous; tokens: a literal.
    """
    arrays = (tmp, bt, bt_scales, out)
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
        return None
    if tmp.dtype != types.float32 or out.dtype != types.float32 or bt.dtype not in _STORED:
        return None
    if not isinstance(tokens, types.IntegerLiteral):
        return None
    TB = tokens.literal_value

    def codegen(context, builder, signature, args):
        ta, ba, sa, oa = (context.make_array(ty)(context, builder, value)
                          for ty, value in zip(signature.args[:4], args[:4]))
        t0_, n0_, c0_, r_ = (context.cast(builder, v, ty, types.int64)
                             for v, ty in zip(args[4:8], signature.args[4:8]))
        scale = _splat(builder, context.cast(builder, args[8], signature.args[8], types.float32))
        R = cgutils.unpack_tuple(builder, ta.shape, 2)[1]
        N = cgutils.unpack_tuple(builder, ba.shape, 2)[1]
        N_out = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        rows = [builder.add(t0_, ir.Constant(_I64, t)) for t in range(TB)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_VF32, None)) for _ in range(TB)]
        with cgutils.for_range(builder, r_) as loop:  # rank by rank, one FMA chain per output
            j = loop.index
            b = _load_f32(builder, signature.args[1], ba.data, sa.data, N, j, n0_)
            for t in range(TB):
                w = builder.load(builder.gep(ta.data, [builder.add(builder.mul(rows[t], R), j)]))
                builder.store(_fma(builder, _splat(builder, w), b, builder.load(accs[t])), accs[t])
        col = builder.add(c0_, n0_)
        for t in range(TB):
            ptr = builder.bitcast(builder.gep(oa.data, [builder.add(builder.mul(rows[t], N_out), col)]),
                                  _VF32.as_pointer())
            total = builder.fadd(builder.load(ptr, align=1), builder.fmul(scale, builder.load(accs[t])))
            builder.store(total, ptr, align=1)
        return context.get_dummy_value()

    sig = types.none(tmp, bt, bt_scales, out, t0, n0, c0, rank, scaling, tokens)
    return sig, codegen
