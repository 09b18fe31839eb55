"""A register block for int8 activations x Q4_K / Q5_K / Q4_1 / Q5_0 / Q5_1 / IQ4_NL / IQ4_XS weights through
AVX-512 VNNI, written as LLVM IR: 4 weight rows x TB tokens.

As kernels/simd/vnni.py: per group of 256 values each (row, token) pair keeps 8 int32 lanes, lane b = block
b's dot product of the unsigned quants q (kernels/formats/kquant_layout.py) with the int8 activations, through
8 vpdpbusd (exact: |lane| <= 32 x 241 x 127). A quant vector is chunk j // 2's low or high nibbles (q4_0's
mask and shift), and for the 5-bit formats bit j of the group's 32 bytes of fifth bits, shifted to bit 4 and
or-ed in: one load per row and group, then per vector a byte shift and one vpternlog as LLVM emits them.
(Fifth bits stored as one 32-bit lane mask per vector instead, a kmov and a masked blend, had fewer spills but
was no faster.) The IQ4 formats' 4-bit indices go through one vpshufb into their unsigned levels (IQ4_VALUES +
128). The 4 rows' stream of tiles (quants, fifth bits, scales) is prefetched as q4_0's (32 KB ahead at every
block size; nearby distances measured the same).

Then per block, with value = S_b q - M_b (kquant_layout.py's table) and xd_b, xsum_b the activations'
scale and sum, in this order for every token of any batch (so its outputs do not depend on the batch):
    inner = fma(-M_b, float(xsum_b), S_b x float(dot_b)); acc_b = fma(xd_b, inner, acc_b)
where K-quants' S_b = d x sc_b, M_b = dmin x mn_b are float32 products, formed once per row and group,
as gguf's dequantization forms them. Q5_0's offset of 16 and the IQ4 formats' 128 are integers, taken off
the int32 lanes (they start at -offset x xsum_b, q4_0's way), and their blocks fold as q4_0's:
acc_b = fma(float(dot_b), S_b x xd_b, acc_b), IQ4_XS's S_b = d x sc_b (sc_b signed) as gguf forms it. The 8
lanes are summed at the end (store_block).

Needs AVX512-VNNI, AVX512-VL and F16C (simd_vnni.VNNI_FEATURES); with vnni 0, AVX2 and F16C
(int8.AVX2_FEATURES): each vpdpbusd becomes vpmaddubsw + vpmaddwd by ones + vpaddd, the same int32 lanes.
numba's on-disk cache of kernels/linear/kquant.py does not notice edits to this file: after changing the code
generation here, delete kernels/__pycache__.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.formats.kquant_layout import FORMATS, IQ4_UNSIGNED
from kernels.simd.int8 import (
    GROUP,
    I8,
    V8F,
    V8I,
    block_operands,
    const64,
    fma_function,
    fold_group,
    group_counts,
    load_vec,
    operands_fit,
    store_block,
)
from kernels.simd.vnni import ROWS, V32I8, dpbusd_avx2, dpbusd_function, nibble_vector, prefetch_ahead

V8H = ir.VectorType(ir.HalfType(), 8)
# the formats whose quants pass through vpmaddubsw exactly (vnni.dpbusd_avx2): all but the IQ4 levels
AVX2_FORMATS = {code: f for code, f in FORMATS.items() if not f.table}
V8I8 = ir.VectorType(I8, 8)


def _splat_f16(builder, data, offset):
    # the fp16 at byte offset of data in all 8 float32 lanes: splat as halves, then convert (a broadcast load
    # and one vcvtph2ps; converting first took a word insert, the convert and a broadcast)
    half = builder.load(builder.bitcast(builder.gep(data, [offset]), ir.HalfType().as_pointer()), align=1)
    vec = builder.insert_element(ir.Constant(V8H, None), half, ir.Constant(ir.IntType(32), 0))
    zeros = ir.Constant(ir.VectorType(ir.IntType(32), 8), [0] * 8)
    return builder.fpext(builder.shuffle_vector(vec, vec, zeros), V8F)


def _weight_vector(builder, f, chunk, high, j):
    # vector j's unsigned quants as <8 x i32>: chunk j // 2's nibbles, the fifth bits or-ed in (5-bit
    # formats), the IQ4 indices looked up in their levels + 128 by vpshufb (per 128-bit lane, each byte
    # (0..15) picks a byte of the table's lane)
    v = nibble_vector(builder, chunk, j)
    if high is not None:
        v = builder.or_(v, _fifth_bits(builder, high, j))
    if f.table:
        pshufb = cgutils.get_or_insert_function(builder.module, ir.FunctionType(V32I8, [V32I8, V32I8]),
                                                "llvm.x86.avx2.pshuf.b")
        v = builder.call(pshufb, [ir.Constant(V32I8, [int(level) for level in IQ4_UNSIGNED] * 2), v])
    return builder.bitcast(v, V8I)


def group_weights(builder, f, data, tile):
    """j -> the 4 rows' quant vectors j (<8 x i32>) of the group whose tile starts at byte `tile` of data, for
    j = 0..7 in order (a row's chunk loaded at even j, its fifth bits once)."""
    chunks = [None] * ROWS
    highs = [load_vec(builder, data, builder.add(tile, const64(f.tile_offsets["high"] + 32 * r)), V32I8)
             for r in range(ROWS)] if f.bits == 5 else [None] * ROWS

    def vectors(j):
        for r in range(ROWS):
            if j % 2 == 0:
                at = builder.add(tile, const64(GROUP // 2 * r + 16 * j))  # row r's chunk j // 2
                chunks[r] = load_vec(builder, data, at, V32I8)
        return [_weight_vector(builder, f, chunks[r], highs[r], j) for r in range(ROWS)]
    return vectors


def offset_sums(builder, f, xsum, vec_type):
    """The int32 accumulators' start per token (or pair) from its block sums xsum: 0, or -offset x xsum for
    the formats whose quants carry an offset (Q5_0: q - 16; IQ4: level + 128 - 128)."""
    if f.has_min:
        return [ir.Constant(vec_type, None)] * len(xsum)
    return [builder.mul(s, ir.Constant(vec_type, [-f.offset] * vec_type.count)) for s in xsum]


def _fifth_bits(builder, high, j):
    # vector j's fifth bits (bit j of each byte of the group's 32 bytes) at bit 4, the rest 0
    if j < 4:
        high = builder.shl(high, ir.Constant(V32I8, [4 - j] * 32))
    elif j > 4:
        high = builder.lshr(high, ir.Constant(V32I8, [j - 4] * 32))
    return builder.and_(high, ir.Constant(V32I8, [16] * 32))


def block_scales(builder, data, tile, f, r):
    # row r's (S, M) per block of this group (value = S q - M) from its tile at byte `tile` (M None for Q5_0)
    at = f.tile_offsets

    def part(name, width):
        return builder.add(tile, const64(at[name] + width * r))

    if f.super_block and f.table:  # IQ4_XS: signed scales, no min
        sc = builder.sitofp(load_vec(builder, data, part("scales", 8), V8I8), V8F)
        return builder.fmul(_splat_f16(builder, data, part("d", 2)), sc), None
    if f.super_block:
        sc, mn = (builder.uitofp(load_vec(builder, data, part(name, 8), V8I8), V8F)
                  for name in ("scales", "mins"))
        return (builder.fmul(_splat_f16(builder, data, part("d", 2)), sc),
                builder.fmul(_splat_f16(builder, data, part("dmin", 2)), mn))
    s, m = (builder.fpext(load_vec(builder, data, part(name, 16), V8H), V8F) if name in at else None
            for name in ("d", "m"))
    return s, builder.fneg(m) if m else None  # Q4_1, Q5_1: value = d q + m


def _dot(builder, use_vnni: bool):
    """(acc, weights, x) -> acc + vpdpbusd(weights, x): VNNI's instruction or AVX2's same integers."""
    if not use_vnni:
        return lambda acc, weights, x: dpbusd_avx2(builder, acc, weights, x)
    vpdpbusd = dpbusd_function(builder.module)
    return lambda acc, weights, x: builder.call(vpdpbusd, [acc, weights, x])


@intrinsic(prefer_literal=True)
def kquant_block(typingctx, xq, xd, xsum, data, out, t0, n0, qtype, tokens, vnni):
    """out[t0:t0+tokens, n0:n0+4] = the int8 dot products of quantized x with 4 packed W rows (those < N).

    xq: [T, Kp] int8 (quad order), xd/xsum: [T, Kp // 32] f32/int32, data: uint8 [N4, ...] packed by
    kquant_layout.pack_kquant, out: [T, N] f32; n0 % 4 == 0; qtype (a GGML type id in kquant_layout.FORMATS),
    tokens, vnni (1: vpdpbusd; 0: vnni.dpbusd_avx2, the same integers, for AVX2_FORMATS): literals.
    """
    if not operands_fit((xq, xd, xsum, data, out),
                        (types.int8, types.float32, types.int32, types.uint8, types.float32)):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, tokens, vnni)):
        return None
    if qtype.literal_value not in (FORMATS if vnni.literal_value else AVX2_FORMATS):
        return None
    f, TB, use_vnni = FORMATS[qtype.literal_value], tokens.literal_value, bool(vnni.literal_value)
    tile_bytes = f.tile_offsets["end"]

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args, 5)
        num_blocks, num_groups = group_counts(builder, Kp)
        module = builder.module
        dpbusd = _dot(builder, use_vnni)
        fma = fma_function(module)
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first tile
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V8F, None)) for _ in range(TB)]
                for _ in range(ROWS)]
        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [builder.add(builder.mul(row, Kp), builder.mul(g, const64(GROUP))) for row in token_rows]
            tile = builder.mul(builder.add(block_base, g), const64(tile_bytes))
            prefetch_ahead(builder, wa.data, tile, tile_bytes, TB)
            xsum_ = [load_vec(builder, sa.data, builder.add(builder.mul(row, num_blocks), blk0), V8I)
                     for row in token_rows]
            init = offset_sums(builder, f, xsum_, V8I)
            iacc = [list(init) for _ in range(ROWS)]
            weights_of = group_weights(builder, f, wa.data, tile)
            for j in range(8):
                weights = weights_of(j)
                for t in range(TB):
                    xv = builder.bitcast(load_vec(builder, xa.data, builder.add(x_base[t], const64(32 * j)),
                                                  V32I8), V8I)
                    for r in range(ROWS):
                        iacc[r][t] = dpbusd(iacc[r][t], weights[r], xv)
            # the scales after the products: formed before, they stayed live through them and spilled
            dx = [load_vec(builder, da.data, builder.add(builder.mul(row, num_blocks), blk0), V8F)
                  for row in token_rows]
            scales = [block_scales(builder, wa.data, tile, f, r) for r in range(ROWS)]
            if not f.has_min:
                fold_group(builder, fma, iacc, [s for s, _ in scales], dx, accs)
            else:
                xsum_f = [builder.sitofp(s, V8F) for s in xsum_]
                for r, (s, m) in enumerate(scales):
                    minus_m = builder.fneg(m)  # folded into the fma (vfnmadd; Q4_1's -(-m) cancels)
                    for t in range(TB):
                        scaled = builder.fmul(s, builder.sitofp(iacc[r][t], V8F))
                        inner = builder.call(fma, [minus_m, xsum_f[t], scaled])
                        builder.store(builder.call(fma, [dx[t], inner, builder.load(accs[r][t])]), accs[r][t])
        store_block(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, out, t0, n0, qtype, tokens, vnni), codegen
