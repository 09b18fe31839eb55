"""A register block for int8 activations x GGUF Q6_K weights through AVX-512 VNNI, written as LLVM IR:
4 weight rows x TB tokens.

Per group of 256 values (kernels/q6k_layout.py), each (row, token) keeps one 512-bit int32 accumulator: 4
vpdpbusd of the 6-bit values (0..63, the unsigned side) by pairs of activation vectors [vector f | vector
f + 4] (the signed side) leave block b's first 16-value sub-block's sum in lane b and its second one's in
lane 8 + b. The accumulator starts at the token's offsets (-32 x the sub-block sums of x), so it ends at
the sums of x (q - 32). One vpmulld by the row's 16 int8 scales (laid out in those lanes) and one add of the
two halves give block b's exact int32 dot product: |sub-block sum| <= 16 x 32 x 127, x 128, twice, is
below 2**24, so the convert that follows is exact too. Then, as every int8 kernel (kernels/simd_int8.py
fold_group), one fused multiply-add by (d x activation scale) per lane moves a group into a float32
accumulator, in group order: a token's outputs are the same bits whatever the other tokens of its block.

The offsets come from memory (kernels/q6k_layout.py subblock_offsets, once per call) rather than from 4
vpdpbusd against a constant per token and group, which cost a fifth of the block's time at 32 tokens.
Weights stream as in kernels/simd_vnni.py: one sequential stream per task (a block's 4 rows interleaved by
group), prefetched PREFETCH_BYTES ahead into L2, and d's small stream alongside. Rows past the matrix's last
(padding of the last block) are computed, not stored.

Needs AVX512-VNNI, AVX512-BW (512-bit byte vectors) and F16C. numba's on-disk cache of
kernels/linear_q6k.py does not notice edits to this file: after changing the code generation here, delete
kernels/__pycache__.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.q6k_layout import BLOCK_BYTES, ROWS, SCALES, VALUES
from kernels.simd_int8 import (
    GROUP,
    I8,
    I32,
    V8F,
    block_operands,
    const64,
    fold_group,
    load_vec,
    operands_fit,
    store_block,
)
from kernels.simd_vnni import PREFETCH_BYTES, PREFETCH_LOCALITY

I16 = ir.IntType(16)
V32I8, V64I8, V32I16 = ir.VectorType(I8, 32), ir.VectorType(I8, 64), ir.VectorType(I16, 32)
V16I8, V16I = ir.VectorType(I8, 16), ir.VectorType(I32, 16)
V4H, V4F = ir.VectorType(ir.HalfType(), 4), ir.VectorType(ir.FloatType(), 4)
Q6K_FEATURES = ("avx512vnni", "avx512bw", "f16c")
_D_PREFETCH = PREFETCH_BYTES * ROWS * 2 // BLOCK_BYTES  # d's bytes as far ahead as the values' stream


def _bytes(value):
    return ir.Constant(V64I8, [value] * 64)


def _shift_words(builder, v, bits):
    # v >> bits in 16-bit lanes (vpsrlw; a byte shift is lowered to slower GFNI operations)
    return builder.bitcast(builder.lshr(builder.bitcast(v, V32I16), ir.Constant(V32I16, [bits] * 32)), V64I8)


def _decode(builder, a, b, c):
    """A row's group of values, kernels/q6k_layout.py's A, B, C -> its 4 pairs of 6-bit values."""
    six = _bytes(63)
    top = builder.or_(builder.or_(builder.and_(_shift_words(builder, a, 6), _bytes(0x03)),
                                  builder.and_(_shift_words(builder, b, 4), _bytes(0x0C))),
                      builder.and_(_shift_words(builder, c, 2), _bytes(0x30)))
    return [builder.bitcast(builder.and_(v, six), V16I) for v in (a, b, c)] + [builder.bitcast(top, V16I)]


def _load64(builder, base, at, offset):
    return load_vec(builder, base, builder.add(at, const64(offset)), V64I8)


def _x_pairs(builder, xq, at):
    """A token's group of activations at xq[at] -> its 4 pairs [vector f | vector f + 4]."""
    concat = ir.Constant(ir.VectorType(I32, 64), list(range(64)))
    vectors = [load_vec(builder, xq, builder.add(at, const64(32 * j)), V32I8) for j in range(8)]
    return [builder.bitcast(builder.shuffle_vector(vectors[f], vectors[f + 4], concat), V16I)
            for f in range(4)]


@intrinsic(prefer_literal=True)
def q6k_block(typingctx, xq, xd, offsets, data, d, out, t0, n0, tokens):
    """out[t0:t0+tokens, n0:n0+4] = the int8 dot products of quantized x with 4 packed Q6_K rows (those < N).

    xq: [T, Kp] int8 (quad order), xd: [T, Kp // 32] f32, offsets: [T, Kp // 16] int32 (subblock_offsets),
    data: uint8 [N4, G * 208], d: uint16 [N4, G] (kernels/q6k_layout.py), out: [T, N] f32; n0 % 4 == 0;
    tokens: a literal.
    """
    if not operands_fit((xq, xd, offsets, data, d, out),
                        (types.int8, types.float32, types.int32, types.uint8, types.uint16, types.float32)):
        return None
    if not isinstance(tokens, types.IntegerLiteral):
        return None
    TB = tokens.literal_value

    def codegen(context, builder, signature, args):
        (xa, da, oa_, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks = builder.udiv(Kp, const64(32))
        num_groups = builder.udiv(Kp, const64(GROUP))
        module = builder.module
        dpbusd = cgutils.get_or_insert_function(module, ir.FunctionType(V16I, [V16I] * 3),
                                                "llvm.x86.avx512.vpdpbusd.512")
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(V8F, [V8F] * 3), "llvm.fma.v8f32")
        i8_ptr = I8.as_pointer()
        prefetch = cgutils.get_or_insert_function(module,
                                                  ir.FunctionType(ir.VoidType(), [i8_ptr, I32, I32, I32]),
                                                  "llvm.prefetch.p0")

        def prefetch_l2(base, offset):  # a hint: never faults, even past the array
            ptr = builder.bitcast(builder.gep(base, [offset]), i8_ptr)
            builder.call(prefetch, [ptr, ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY),
                                    ir.Constant(I32, 1)])

        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first group
        x_at = [builder.mul(row, Kp) for row in token_rows]
        offsets_at = [builder.mul(row, builder.mul(num_groups, const64(16))) for row in token_rows]
        halves = [ir.Constant(ir.VectorType(I32, 8), list(range(h, h + 8))) for h in (0, 8)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)]
                for _ in range(ROWS)]
        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            stream = builder.mul(builder.add(block_base, g), const64(BLOCK_BYTES))  # this group of the 4 rows
            for line in range(0, BLOCK_BYTES, 64):
                prefetch_l2(wa.data, builder.add(stream, const64(PREFETCH_BYTES + line)))
            d_at = builder.mul(builder.add(block_base, g), const64(ROWS))
            prefetch_l2(ca.data, builder.add(d_at, const64(_D_PREFETCH)))
            d4 = builder.fpext(load_vec(builder, ca.data, d_at, V4H), V4F)
            dw = [builder.shuffle_vector(d4, d4, ir.Constant(ir.VectorType(I32, 8), [r] * 8))
                  for r in range(ROWS)]
            dx = [load_vec(builder, da.data, builder.add(builder.mul(row, num_blocks), blk0), V8F)
                  for row in token_rows]
            init = [load_vec(builder, oa_.data, builder.add(at, builder.mul(g, const64(16))), V16I)
                    for at in offsets_at]
            pairs = [_x_pairs(builder, xa.data, builder.add(at, builder.mul(g, const64(GROUP))))
                     for at in x_at]
            weights = [_decode(builder, *(_load64(builder, wa.data, stream, VALUES + 192 * r + 64 * v)
                                          for v in range(3))) for r in range(ROWS)]
            scales = [builder.sext(load_vec(builder, wa.data, builder.add(stream, const64(SCALES + 16 * r)),
                                            V16I8), V16I) for r in range(ROWS)]
            sums = []
            for r in range(ROWS):
                row = []
                for t in range(TB):
                    acc = init[t]
                    for f in range(4):
                        acc = builder.call(dpbusd, [acc, weights[r][f], pairs[t][f]])
                    scaled = builder.mul(acc, scales[r])
                    row.append(builder.add(builder.shuffle_vector(scaled, scaled, halves[0]),
                                           builder.shuffle_vector(scaled, scaled, halves[1])))
                sums.append(row)
            fold_group(builder, fma, sums, dw, dx, accs)
        store_block(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, offsets, data, d, out, t0, n0, tokens), codegen
