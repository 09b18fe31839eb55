"""A register block for int8 activations x quantized weights, written as LLVM IR: R weight rows x TB tokens.

Per group of 8 blocks (kernels/formats/int8_layout.py) each (row, token) pair keeps an int32 accumulator of 8
lanes, lane b = block b: 16 pairwise multiply-adds of int16 vectors (vpmaddwd: |w| <= 127 and
|x| <= 127, so every sum is exact) fill it with the 8 blocks' integer dot products; then one
convert and one fused multiply-add by (weight scale x activation scale) per lane moves it into a
float32 accumulator. A weight vector is widened once and used by all TB tokens; an activation vector
by all R rows. q4_0's nibbles are value + 8: the accumulator starts at -8 x (block sum of x).

Needs AVX2 (the 256-bit vpmaddwd) and F16C; kernels/simd/cpu.py says whether the host has them.
numba's on-disk cache of kernels/linear/int8.py does not notice edits to this file: after changing
the code generation here, delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

I8, I16, I32, I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F32 = ir.FloatType()
V8F, V8I = ir.VectorType(F32, 8), ir.VectorType(I32, 8)
V16I8, V16I16 = ir.VectorType(I8, 16), ir.VectorType(I16, 16)
GROUP = 256
AVX2_FEATURES = ("avx2", "f16c")  # every AVX2 int8 block: this one, u8s8.py's, vnni.dpbusd_avx2's


def const64(value):
    return ir.Constant(I64, value)


def load_vec(builder, base, offset, vec_type):
    ptr = builder.gep(base, [offset])
    return builder.load(builder.bitcast(ptr, vec_type.as_pointer()), align=1)


def hsum8(builder, vec):
    # the float lanes' sum, halving: upper half onto lower (a 16-lane vector first folds lanes 8-15 onto 0-7)
    width = vec.type.count
    while width > 1:
        width //= 2
        lo = builder.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(I32, width), list(range(width))))
        hi = builder.shuffle_vector(vec, vec,
                                    ir.Constant(ir.VectorType(I32, width), list(range(width, 2 * width))))
        vec = builder.fadd(lo, hi)
    return builder.extract_element(vec, ir.Constant(I32, 0))


def fold_group(builder, fma, iacc, dw, dx, accs):
    """accs[r][t] += float(iacc[r][t]) x (dw[r] x dx[t]): a group's exact int32 sums moved into the float32
    accumulators, one convert and one fused multiply-add per lane (the order every int8 kernel keeps)."""
    for r, row in enumerate(iacc):
        for t, sums in enumerate(row):
            scale = builder.fmul(dw[r], dx[t])
            builder.store(builder.call(fma, [builder.sitofp(sums, V8F), scale, builder.load(accs[r][t])]),
                          accs[r][t])


def store_block(builder, out_data, accs, token_rows, weight_rows, N):
    """out[token_rows[t], weight_rows[r]] = the horizontal sum of accs[r][t], for the rows < N (a last block's
    padding rows are computed, not stored)."""
    for r, row in enumerate(weight_rows):
        with builder.if_then(builder.icmp_signed("<", row, N), likely=True):
            for t, token in enumerate(token_rows):
                ptr = builder.gep(out_data, [builder.add(builder.mul(token, N), row)])
                builder.store(hsum8(builder, builder.load(accs[r][t])), ptr)


def fma_function(module, lanes: int = 8):
    """llvm.fma on float32 vectors of `lanes` lanes: a x b + c, one rounding."""
    vec = ir.VectorType(F32, lanes)
    return cgutils.get_or_insert_function(module, ir.FunctionType(vec, [vec] * 3), f"llvm.fma.v{lanes}f32")


def group_counts(builder, Kp):
    """(blocks of 32, groups of GROUP) in a row of Kp values, as int64 IR values."""
    return builder.udiv(Kp, const64(32)), builder.udiv(Kp, const64(GROUP))


def operands_fit(arrays, dtypes) -> bool:
    """A block intrinsic's typing check: every array 2-D and C-contiguous, with these dtypes (None: any)."""
    return all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" and (d is None or a.dtype == d)
               for a, d in zip(arrays, dtypes))


def block_operands(context, builder, signature, args, num_arrays=6):
    """A block intrinsic's arrays (xq, xd, xsum, the weight's arrays, out: its first num_arrays arguments),
    t0 and n0 (the next two) as int64, Kp (xq's columns) and N (out's)."""
    arrays = [context.make_array(ty)(context, builder, value)
              for ty, value in zip(signature.args[:num_arrays], args[:num_arrays])]
    t0, n0 = (context.cast(builder, args[i], signature.args[i], types.int64)
              for i in (num_arrays, num_arrays + 1))
    Kp = cgutils.unpack_tuple(builder, arrays[0].shape, 2)[1]
    N = cgutils.unpack_tuple(builder, arrays[-1].shape, 2)[1]
    return arrays, t0, n0, Kp, N


@intrinsic(prefer_literal=True)
def int8_block(typingctx, xq, xd, xsum, data, scales, out, t0, n0, rows, tokens):
    """out[t0:t0+tokens, n0:n0+rows] = the int8 dot products of quantized x with packed W rows.

    xq: [T, Kp] int16, xd/xsum: [T, Kp // 32] f32/int32, data: [N, Kp] int8 (q8_0) or [N, Kp // 2]
    uint8 (q4_0), scales: [N, Kp // 32] uint16 fp16, out: [T, N] f32; rows, tokens: literals.
    """
    if not operands_fit((xq, xd, xsum, data, scales, out),
                        (types.int16, types.float32, types.int32, None, types.uint16, types.float32)):
        return None
    if data.dtype not in (types.int8, types.uint8):
        return None
    if not (isinstance(rows, types.IntegerLiteral) and isinstance(tokens, types.IntegerLiteral)):
        return None
    R, TB = rows.literal_value, tokens.literal_value
    is_q4 = data.dtype == types.uint8

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks = builder.udiv(Kp, const64(32))
        w_per_row = builder.udiv(Kp, const64(2)) if is_q4 else Kp
        module = builder.module
        pmaddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8I, [V16I16, V16I16]),
                                                 "llvm.x86.avx2.pmadd.wd")
        fma = fma_function(module)
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(R)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)]
                for _ in range(R)]

        with cgutils.for_range(builder, builder.udiv(Kp, const64(GROUP))) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [builder.add(builder.mul(row, Kp), builder.mul(g, const64(GROUP))) for row in token_rows]
            w_base = [builder.add(builder.mul(row, w_per_row),
                                  builder.mul(g, const64(GROUP // 2 if is_q4 else GROUP)))
                      for row in weight_rows]
            dx = [load_vec(builder, da.data, builder.add(builder.mul(row, num_blocks), blk0), V8F)
                  for row in token_rows]
            dw = [builder.fpext(load_vec(builder, ca.data, builder.add(builder.mul(row, num_blocks), blk0),
                                      ir.VectorType(ir.HalfType(), 8)), V8F) for row in weight_rows]
            if is_q4:  # value = nibble - 8: start from -8 x the block sums of x
                minus8 = ir.Constant(V8I, [-8] * 8)
                init = [builder.mul(load_vec(builder, sa.data,
                                             builder.add(builder.mul(row, num_blocks), blk0), V8I),
                                    minus8) for row in token_rows]
            else:
                init = [ir.Constant(V8I, None)] * TB
            iacc = [[init[t] for t in range(TB)] for _ in range(R)]
            nibbles = [None] * R
            for j in range(16):
                weights = []
                for r in range(R):
                    if is_q4:
                        if j % 2 == 0:
                            nibbles[r] = load_vec(builder, wa.data, builder.add(w_base[r], const64(8 * j)),
                                                  V16I8)
                        v = nibbles[r]
                        v = builder.and_(v, ir.Constant(V16I8, [15] * 16)) if j % 2 == 0 else builder.lshr(
                            v, ir.Constant(V16I8, [4] * 16))
                        weights.append(builder.zext(v, V16I16))
                    else:
                        weights.append(builder.sext(load_vec(builder, wa.data,
                                                             builder.add(w_base[r], const64(16 * j)),
                                                             V16I8), V16I16))
                for t in range(TB):
                    xv = load_vec(builder, xa.data, builder.add(x_base[t], const64(16 * j)), V16I16)
                    for r in range(R):
                        iacc[r][t] = builder.add(iacc[r][t], builder.call(pmaddwd, [weights[r], xv]))
            fold_group(builder, fma, iacc, dw, dx, accs)
        store_block(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, scales, out, t0, n0, rows, tokens), codegen

