"""A register block for int8 activations x q4_0 weights, written as LLVM IR: 1 weight row x TB tokens.

q4_0 uses the quad layout (kernels/formats/int8_layout.py): per group of 8 blocks, vector j (32 values) holds
4 consecutive values of each block, so one unsigned x signed byte multiply-add (vpmaddubsw, 32 products
per instruction) leaves block b's pair sums in int16 lanes 2b and 2b + 1. The weights' nibbles (0..15)
are the unsigned side and need no widening, only a mask and a shift. |nibble x x| <= 15 x 127, so a pair
sums to at most 3810 and the 8 vectors of a group to at most 30480: exact in int16 without saturation.
One vpmaddwd by ones per group then folds the pairs into int32 lane b = block b's dot product with the
nibbles, the nibbles' offset of 8 is taken off as -8 x (block sum of x), and one convert and one fused
multiply-add by (weight scale x activation scale) per lane moves it into a float32 accumulator.

Needs AVX2 (256-bit vpmaddubsw / vpmaddwd) and F16C, as kernels/simd/int8.py. numba's on-disk cache of
kernels/linear/int8.py does not notice edits to this file: after changing the code generation here,
delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import (
    GROUP,
    I8,
    V8F,
    V8I,
    V16I16,
    block_operands,
    const64,
    fma_function,
    hsum8,
    load_vec,
    operands_fit,
)

V32I8 = ir.VectorType(I8, 32)


@intrinsic(prefer_literal=True)
def u8s8_block(typingctx, xq, xd, xsum, data, scales, out, t0, n0, tokens):
    """out[t0:t0+tokens, n0] = the int8 dot products of quantized x with one packed q4_0 row.

    xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32] f32/int32, data: [N, Kp // 2] uint8,
    scales: [N, Kp // 32] uint16 fp16, out: [T, N] f32; tokens: a literal.
    """
    if not operands_fit((xq, xd, xsum, data, scales, out),
                        (types.int8, types.float32, types.int32, types.uint8, types.uint16, types.float32)):
        return None
    if not isinstance(tokens, types.IntegerLiteral):
        return None
    TB = tokens.literal_value

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks = builder.udiv(Kp, const64(32))
        module = builder.module
        pmaddubsw = cgutils.get_or_insert_function(module, ir.FunctionType(V16I16, [V32I8, V32I8]),
                                                   "llvm.x86.avx2.pmadd.ub.sw")
        pmaddwd = cgutils.get_or_insert_function(module, ir.FunctionType(V8I, [V16I16, V16I16]),
                                                 "llvm.x86.avx2.pmadd.wd")
        fma = fma_function(module)
        ones = ir.Constant(V16I16, [1] * 16)
        low = ir.Constant(V32I8, [15] * 32)
        four = ir.Constant(V32I8, [4] * 32)
        minus8 = ir.Constant(V8I, [-8] * 8)
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        accs = [cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)]

        with cgutils.for_range(builder, builder.udiv(Kp, const64(GROUP))) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [builder.add(builder.mul(row, Kp), builder.mul(g, const64(GROUP))) for row in token_rows]
            w_base = builder.add(builder.mul(n0_, builder.udiv(Kp, const64(2))),
                                 builder.mul(g, const64(GROUP // 2)))
            dw = builder.fpext(load_vec(builder, ca.data, builder.add(builder.mul(n0_, num_blocks), blk0),
                                     ir.VectorType(ir.HalfType(), 8)), V8F)
            pairs = [ir.Constant(V16I16, None)] * TB
            for c in range(4):  # chunk c: vector 2c in the low nibbles, 2c + 1 in the high ones
                packed = load_vec(builder, wa.data, builder.add(w_base, const64(32 * c)), V32I8)
                nibbles = (builder.and_(packed, low), builder.and_(builder.lshr(packed, four), low))
                for half, w in enumerate(nibbles):
                    for t in range(TB):
                        xv = load_vec(builder, xa.data, builder.add(x_base[t], const64(32 * (2 * c + half))),
                                      V32I8)
                        pairs[t] = builder.add(pairs[t], builder.call(pmaddubsw, [w, xv]))
            for t in range(TB):
                xs = load_vec(builder, sa.data, builder.add(builder.mul(token_rows[t], num_blocks), blk0),
                              V8I)
                blocks = builder.add(builder.call(pmaddwd, [pairs[t], ones]), builder.mul(xs, minus8))
                dx = load_vec(builder, da.data, builder.add(builder.mul(token_rows[t], num_blocks), blk0),
                              V8F)
                total = builder.call(fma, [builder.sitofp(blocks, V8F), builder.fmul(dw, dx),
                                           builder.load(accs[t])])
                builder.store(total, accs[t])
        for t in range(TB):
            ptr = builder.gep(oa.data, [builder.add(builder.mul(token_rows[t], N), n0_)])
            builder.store(hsum8(builder, builder.load(accs[t])), ptr)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, scales, out, t0, n0, tokens), codegen
