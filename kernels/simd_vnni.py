"""A register block for int8 activations x q8_0 / q4_0 weights through AVX-512 VNNI, written as LLVM IR:
R weight rows x TB tokens.

Both formats use the quad order (kernels/int8_layout.py): per group of 8 blocks, vector j (32 bytes) holds
4 consecutive values of each block, so one unsigned x signed byte dot product (vpdpbusd: 32 products
summed by fours into 8 int32 lanes, accumulated) adds block b's partial dot product to lane b. The
weights are the unsigned side: q4_0's nibbles are value + 8, and q8_0's bytes are stored as value + 128
(Int8Matrix.pack when the host has VNNI); the offset is taken off once per group as -offset x (block sum
of x), the accumulator's start. Sums stay exact in int32 (|lane| <= 32 x 255 x 127). Then, as in
kernels/simd_int8.py, one convert and one fused multiply-add by (weight scale x activation scale) per lane
move a group into a float32 accumulator, in the same order: the outputs are bit for bit those of the
AVX2 kernels, with one instruction per 32 products instead of two to three per 16.

Needs AVX512-VNNI and AVX512-VL (the 256-bit vpdpbusd) and F16C. numba's on-disk cache of
kernels/linear_int8.py does not notice edits to this file: after changing the code generation here,
delete kernels/__pycache__ (a fresh install starts without a cache).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd_int8 import GROUP, I8, V8F, V8I, block_operands, const64, hsum8, load_vec

V32I8 = ir.VectorType(I8, 32)
VNNI_FEATURES = ("avx512vnni", "avx512vl", "f16c")


@intrinsic(prefer_literal=True)
def vnni_block(typingctx, xq, xd, xsum, data, scales, out, t0, n0, bits, rows, tokens):
    """out[t0:t0+tokens, n0:n0+rows] = the int8 dot products of quantized x with packed W rows.

    xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32] f32/int32, data: uint8 [N, Kp] (q8_0, value +
    128) or [N, Kp // 2] (q4_0 nibbles), scales: [N, Kp // 32] uint16 fp16, out: [T, N] f32;
    bits (8 | 4), rows, tokens: literals.
    """
    arrays = (xq, xd, xsum, data, scales, out)
    if not all(isinstance(a, types.Array) and a.ndim == 2 and a.layout == "C" for a in arrays):
        return None
    if (xq.dtype, xd.dtype, xsum.dtype, data.dtype, scales.dtype, out.dtype) != (
            types.int8, types.float32, types.int32, types.uint8, types.uint16, types.float32):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (bits, rows, tokens)):
        return None
    if bits.literal_value not in (4, 8):
        return None
    is_q4, R, TB = bits.literal_value == 4, rows.literal_value, tokens.literal_value
    offset = 8 if is_q4 else 128

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks = builder.udiv(Kp, const64(32))
        w_per_row = builder.udiv(Kp, const64(2)) if is_q4 else Kp
        module = builder.module
        # the byte operands typed <8 x i32>, the form every LLVM since VNNI's introduction accepts
        dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(V8I, [V8I] * 3), "llvm.x86.avx512.vpdpbusd.256")
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
        low, four = ir.Constant(V32I8, [15] * 32), ir.Constant(V32I8, [4] * 32)
        minus_offset = ir.Constant(V8I, [-offset] * 8)
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(R)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)] for _ in range(R)]

        with cgutils.for_range(builder, builder.udiv(Kp, const64(GROUP))) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [builder.add(builder.mul(row, Kp), builder.mul(g, const64(GROUP))) for row in token_rows]
            w_base = [builder.add(builder.mul(row, w_per_row), builder.mul(g, const64(GROUP // 2 if is_q4 else GROUP)))
                      for row in weight_rows]
            dx = [load_vec(builder, da.data, builder.add(builder.mul(row, num_blocks), blk0), V8F) for row in token_rows]
            dw = [builder.fpext(load_vec(builder, ca.data, builder.add(builder.mul(row, num_blocks), blk0),
                                      ir.VectorType(ir.HalfType(), 8)), V8F) for row in weight_rows]
            init = [builder.mul(load_vec(builder, sa.data, builder.add(builder.mul(row, num_blocks), blk0), V8I),
                                minus_offset) for row in token_rows]
            iacc = [list(init) for _ in range(R)]
            packed = [None] * R
            for j in range(8):
                weights = []
                for r in range(R):
                    if is_q4:  # chunk j // 2: vector j // 2 * 2 in its low nibbles, the next in its high ones
                        if j % 2 == 0:
                            packed[r] = load_vec(builder, wa.data, builder.add(w_base[r], const64(16 * j)), V32I8)
                        v = builder.and_(packed[r], low) if j % 2 == 0 else builder.and_(
                            builder.lshr(packed[r], four), low)
                    else:
                        v = load_vec(builder, wa.data, builder.add(w_base[r], const64(32 * j)), V32I8)
                    weights.append(builder.bitcast(v, V8I))
                for t in range(TB):
                    xv = builder.bitcast(load_vec(builder, xa.data, builder.add(x_base[t], const64(32 * j)), V32I8), V8I)
                    for r in range(R):
                        iacc[r][t] = builder.call(dpbusd, [iacc[r][t], weights[r], xv])
            for r in range(R):
                for t in range(TB):
                    scale = builder.fmul(dw[r], dx[t])
                    total = builder.call(fma, [builder.sitofp(iacc[r][t], V8F), scale, builder.load(accs[r][t])])
                    builder.store(total, accs[r][t])
        for t in range(TB):
            out_row = builder.mul(token_rows[t], N)
            for r in range(R):
                ptr = builder.gep(oa.data, [builder.add(out_row, weight_rows[r])])
                builder.store(hsum8(builder, builder.load(accs[r][t])), ptr)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, scales, out, t0, n0, bits, rows, tokens), codegen
