"""A register block for int8 activations x GGUF Q6_K weights through AVX-512 VNNI, written as LLVM IR:
4 weight rows x TB tokens.

Per group of 256 values (kernels/formats/q6k_layout.py), each (row, token) keeps one 512-bit int32
accumulator: 4 vpdpbusd of the 6-bit values (0..63, the unsigned side) by pairs of activation vectors [vector
f | vector f + 4] (the signed side) leave block b's first 16-value sub-block's sum in lane b and its second
one's in lane 8 + b. The accumulator starts at the token's offsets (-32 x the sub-block sums of x), so it ends
at the sums of x (q - 32), exact. Those half sums, converted, times the row's 16 scales (laid out in those
lanes) and the two halves added give block b's exact dot product as a float32 (_fold_rows: no step rounds).
Then, as in every int8 kernel (kernels/simd/int8.py fold_group), one fused multiply-add by (d x activation
scale) per lane moves a group into a float32 accumulator, in group order, and the 8 lanes are summed at the
end in one order: a token's outputs are the same bits whatever its batch and its place in it.

Choices, each measured against the alternative named (benchmarks/results/HISTORY.md):
  the offsets come from memory (kernels/formats/q6k_layout.py subblock_offsets, once per call): 4 vpdpbusd
      against a constant per token and group instead cost more at 32 tokens;
  two rows' block sums share one 512-bit float32 accumulator (the halves' add is then a two-source shuffle),
      16 -> 8 float registers at 4 tokens: faster at 8 tokens than one 256-bit accumulator per (row, token);
  the scales multiply in float32, exactly: vpmulld by the int32 scales (the same sums) was slower at 8 and
      32 tokens;
  the values' decode is shifts and masks (kernels/formats/q6k_layout.py); the 2-bit moves as vgf2p8affineqb
      were no faster;
  4 rows x 4 tokens beats 4 x 3 and 4 x 2 though its 16 + 8 accumulators still spill a few registers (4 x 2's
      do not, but it decodes each row's values for 2 tokens only); splitting the 4-row block into 2 x 4 was
      slower in a draft;
  the prefetch distance (8 to 32 KB) and prefetching d's small stream made no difference at 1 token.
Weights stream as in kernels/simd/vnni.py: one sequential stream per task (a block's 4 rows interleaved by
group), prefetched as there (at every block size); d's stream (1/104 of the bytes) is left to the hardware.
Rows past the matrix's last (padding of the last block) are computed, not stored.

Needs AVX512-VNNI, AVX512-BW (512-bit byte vectors) and F16C; with vnni 0, AVX2 and F16C
(int8.AVX2_FEATURES): each 512-bit operation as two 256-bit ones, vpdpbusd as vnni.dpbusd_avx2 on each half.
numba's on-disk cache of kernels/linear/q6k.py does not notice edits to this file: after changing the code
generation here, delete kernels/__pycache__.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.formats.q6k_layout import BLOCK_BYTES, ROWS, SCALES, VALUES
from kernels.simd.int8 import (
    GROUP,
    I8,
    I32,
    block_operands,
    const64,
    fma_function,
    group_counts,
    hsum8,
    load_vec,
    operands_fit,
)
from kernels.simd.vnni import dpbusd_avx2, dpbusd_function, prefetch_ahead

I16 = ir.IntType(16)
V32I8, V64I8, V32I16 = ir.VectorType(I8, 32), ir.VectorType(I8, 64), ir.VectorType(I16, 32)
V16I8, V16I = ir.VectorType(I8, 16), ir.VectorType(I32, 16)
F32 = ir.FloatType()
V4H, V4F, V8F = ir.VectorType(ir.HalfType(), 4), ir.VectorType(F32, 4), ir.VectorType(F32, 8)
V16F = ir.VectorType(F32, 16)
Q6K_FEATURES = ("avx512vnni", "avx512bw", "f16c")


def _lanes(indices):
    return ir.Constant(ir.VectorType(I32, len(indices)), list(indices))


FIRST_HALVES, SECOND_HALVES = _lanes([*range(8), *range(16, 24)]), _lanes([*range(8, 16), *range(24, 32)])


def _bytes(value):
    return ir.Constant(V64I8, [value] * 64)


def _shift_words(builder, v, bits):
    # v >> bits in 16-bit lanes (vpsrlw; a byte shift is lowered to slower GFNI operations)
    return builder.bitcast(builder.lshr(builder.bitcast(v, V32I16), ir.Constant(V32I16, [bits] * 32)), V64I8)


def _decode(builder, a, b, c):
    """A row's group of values, kernels/formats/q6k_layout.py's A, B, C -> its 4 pairs of 6-bit values."""
    six = _bytes(63)
    top = builder.or_(builder.or_(builder.and_(_shift_words(builder, a, 6), _bytes(0x03)),
                                  builder.and_(_shift_words(builder, b, 4), _bytes(0x0C))),
                      builder.and_(_shift_words(builder, c, 2), _bytes(0x30)))
    return [builder.bitcast(builder.and_(v, six), V16I) for v in (a, b, c)] + [builder.bitcast(top, V16I)]


def _row_weights(builder, data, stream, r):
    """Row r's group in the block's stream -> (its 4 pairs of values, its scales as int32 lanes)."""
    a, b, c = (load_vec(builder, data, builder.add(stream, const64(VALUES + 192 * r + 64 * v)), V64I8)
               for v in range(3))
    scales = load_vec(builder, data, builder.add(stream, const64(SCALES + 16 * r)), V16I8)
    return _decode(builder, a, b, c), builder.sext(scales, V16I)


def _x_pairs(builder, xq, at):
    """A token's group of activations at xq[at] -> its 4 pairs [vector f | vector f + 4]."""
    vectors = [load_vec(builder, xq, builder.add(at, const64(32 * j)), V32I8) for j in range(8)]
    return [builder.bitcast(builder.shuffle_vector(vectors[f], vectors[f + 4], _lanes(range(64))), V16I)
            for f in range(4)]


def _pair_scales(builder, scales):
    """Two rows' int32 scales [first halves | second halves] -> float32 [the rows' first halves], [second]."""
    return [builder.sitofp(builder.shuffle_vector(*scales, halves), V16F)
            for halves in (FIRST_HALVES, SECOND_HALVES)]


def _fold_rows(builder, fma, sums, scales, scale, acc):
    """acc (a row pair and a token: the two rows' block lanes side by side) += (the rows' exact block sums) x
    scale; sums: the two rows' int32 half sums [first | second], scales: _pair_scales. Every step before the
    last is exact in float32: a half sum (|.| <= 16 x 32 x 127) converts exactly, its product by a scale
    (<= 2**23) and the two halves' sum (< 2**24) round nothing."""
    first, second = (builder.sitofp(builder.shuffle_vector(*sums, halves), V16F)
                     for halves in (FIRST_HALVES, SECOND_HALVES))
    blocks = builder.call(fma, [first, scales[0], builder.fmul(second, scales[1])])
    builder.store(builder.call(fma, [blocks, scale, builder.load(acc)]), acc)


def _dot_avx2_512(builder, acc, weights, x):
    """vpdpbusd on 512 bits without AVX-512: each 256-bit half through vnni.dpbusd_avx2
    (vpmaddubsw, vpmaddwd by ones), the same int32 lanes; exact for 6-bit values (a pair's 2 x 63 x 127 fits
    int16). The 512-bit generic operations around it LLVM splits into 256-bit ones."""
    halves = [_lanes(range(8)), _lanes(range(8, 16))]
    parts = [dpbusd_avx2(builder, *(builder.shuffle_vector(v, v, h) for v in (acc, weights, x)))
             for h in halves]
    return builder.shuffle_vector(parts[0], parts[1], _lanes(range(16)))


@intrinsic(prefer_literal=True)
def q6k_block(typingctx, xq, xd, offsets, data, d, out, t0, n0, tokens, vnni):
    """out[t0:t0+tokens, n0:n0+4] = the int8 dot products of quantized x with 4 packed Q6_K rows (those < N).

    xq: [T, Kp] int8 (quad order), xd: [T, Kp // 32] f32, offsets: [T, Kp // 16] int32 (subblock_offsets),
    data: uint8 [N4, G * 208], d: uint16 [N4, G] (kernels/formats/q6k_layout.py), out: [T, N] f32; n0 % 4 ==
    0; tokens, vnni (1: vpdpbusd; 0: _dot_avx2_512, the same integers on AVX2): literals.
    """
    if not operands_fit((xq, xd, offsets, data, d, out),
                        (types.int8, types.float32, types.int32, types.uint8, types.uint16, types.float32)):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (tokens, vnni)):
        return None
    TB, use_vnni = tokens.literal_value, bool(vnni.literal_value)

    def codegen(context, builder, signature, args):
        (xa, da, oa_, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks, num_groups = group_counts(builder, Kp)
        module = builder.module
        if use_vnni:
            vpdpbusd = dpbusd_function(module, 512)

            def dpbusd(acc, weights, x):
                return builder.call(vpdpbusd, [acc, weights, x])
        else:
            def dpbusd(acc, weights, x):
                return _dot_avx2_512(builder, acc, weights, x)
        fma = fma_function(module, 16)


        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first group
        x_at = [builder.mul(row, Kp) for row in token_rows]
        xd_at = [builder.mul(row, num_blocks) for row in token_rows]
        offsets_at = [builder.mul(row, builder.mul(num_groups, const64(16))) for row in token_rows]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, None)) for _ in range(TB)]
                for _ in range(ROWS // 2)]
        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            stream = builder.mul(builder.add(block_base, g), const64(BLOCK_BYTES))  # this group of the 4 rows
            prefetch_ahead(builder, wa.data, stream, BLOCK_BYTES, TB)
            d_at = builder.mul(builder.add(block_base, g), const64(ROWS))
            d4 = builder.fpext(load_vec(builder, ca.data, d_at, V4H), V4F)
            dw = [builder.shuffle_vector(d4, d4, _lanes([2 * p] * 8 + [2 * p + 1] * 8))
                  for p in range(ROWS // 2)]
            dx = [load_vec(builder, da.data, builder.add(at, builder.mul(g, const64(8))), V8F)
                  for at in xd_at]
            dx = [builder.shuffle_vector(v, v, _lanes([*range(8)] * 2)) for v in dx]  # both rows of a pair
            init = [load_vec(builder, oa_.data, builder.add(at, builder.mul(g, const64(16))), V16I)
                    for at in offsets_at]
            pairs = [_x_pairs(builder, xa.data, builder.add(at, builder.mul(g, const64(GROUP))))
                     for at in x_at]
            weights, scales = zip(*(_row_weights(builder, wa.data, stream, r) for r in range(ROWS)))
            sums = [list(init) for _ in range(ROWS)]
            for f in range(4):
                for t in range(TB):
                    for r in range(ROWS):
                        sums[r][t] = dpbusd(sums[r][t], weights[r][f], pairs[t][f])
            for p in range(ROWS // 2):
                rows = (2 * p, 2 * p + 1)
                pair_scales = _pair_scales(builder, [scales[r] for r in rows])
                for t in range(TB):
                    _fold_rows(builder, fma, [sums[r][t] for r in rows], pair_scales,
                               builder.fmul(dw[p], dx[t]), accs[p][t])
        for p in range(ROWS // 2):
            for h in range(2):  # the pair's rows: lanes 0-7, 8-15
                row = builder.add(n0_, const64(2 * p + h))
                with builder.if_then(builder.icmp_signed("<", row, N), likely=True):
                    for t, token in enumerate(token_rows):
                        v = builder.load(accs[p][t])
                        total = hsum8(builder, builder.shuffle_vector(v, v, _lanes(range(8 * h, 8 * h + 8))))
                        builder.store(total, builder.gep(oa.data, [builder.add(builder.mul(token, N), row)]))
        return context.get_dummy_value()

    return types.none(xq, xd, offsets, data, d, out, t0, n0, tokens, vnni), codegen
