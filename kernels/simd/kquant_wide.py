"""kernels/simd/kquant.py's register block on 512-bit vectors over paired tokens, as kernels/simd/vnni_wide.py
is vnni.py's: 4 weight rows x 2P tokens (P pairs, kernels/formats/token_pairs.py), a 512-bit accumulator
holding the 8 lanes of (row, t) and of (row, t + 1).

A row's quant vector is formed at 256 bits as kquant.py forms it (nibbles, fifth bits, IQ4 levels) and
broadcast to both halves; a pair's activations, scales and block sums come in one load each; its block
scales (S_b, M_b) are kquant.py's, broadcast. Every lane sees kquant.py's integer sums and its fold, in its
order: the outputs are its bits. VNNI only (the AVX2 path has no 512-bit vpdpbusd).

numba's on-disk cache of kernels/linear/kquant.py does not notice edits to this file: after changing the code
generation here, delete kernels/__pycache__.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.formats.kquant_layout import FORMATS
from kernels.simd.int8 import (
    GROUP,
    block_operands,
    const64,
    fma_function,
    group_counts,
    load_vec,
    operands_fit,
)
from kernels.simd.kquant import block_scales, group_weights, offset_sums
from kernels.simd.vnni import ROWS, dpbusd_function, prefetch_ahead
from kernels.simd.vnni_wide import TWICE, V16F, V16I, pair_group, paired_blocks, store_pairs


@intrinsic(prefer_literal=True)
def kquant_block_wide(typingctx, xq, xd, xsum, data, out, t0, n0, qtype, pairs):
    """out[t0:t0+2*pairs, n0:n0+4] = the int8 dot products of quantized x with 4 packed W rows (those < N).

    Operands as kernels/simd/kquant.kquant_block's, with xq, xd, xsum paired and t0 the first row of a pair;
    qtype (a GGML type id in kquant_layout.FORMATS), pairs: literals.
    """
    if not operands_fit((xq, xd, xsum, data, out),
                        (types.int8, types.float32, types.int32, types.uint8, types.float32)):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (qtype, pairs)):
        return None
    if qtype.literal_value not in FORMATS:
        return None
    f, P = FORMATS[qtype.literal_value], pairs.literal_value
    tile_bytes = f.tile_offsets["end"]

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args, 5)
        num_blocks, num_groups = group_counts(builder, Kp)
        module = builder.module
        dpbusd = dpbusd_function(module, 512)
        fma = fma_function(module, 16)
        token_rows = [builder.add(t0_, const64(t)) for t in range(2 * P)]
        firsts = token_rows[::2]  # each pair's first row
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first tile
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, None)) for _ in range(P)]
                for _ in range(ROWS)]

        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            x_base = [pair_group(builder, first, Kp, g, GROUP) for first in firsts]
            tile = builder.mul(builder.add(block_base, g), const64(tile_bytes))
            prefetch_ahead(builder, wa.data, tile, tile_bytes, 2 * P)
            xsum_ = [paired_blocks(builder, sa.data, first, num_blocks, g, V16I) for first in firsts]
            init = offset_sums(builder, f, xsum_, V16I)
            iacc = [list(init) for _ in range(ROWS)]
            weights_of = group_weights(builder, f, wa.data, tile)
            for j in range(8):
                weights = [twice(builder, w) for w in weights_of(j)]
                for p in range(P):
                    xv = load_vec(builder, xa.data, builder.add(x_base[p], const64(64 * j)), V16I)
                    for r in range(ROWS):
                        iacc[r][p] = builder.call(dpbusd, [iacc[r][p], weights[r], xv])
            # the scales after the products, as kquant.py forms them
            dx = [paired_blocks(builder, da.data, first, num_blocks, g, V16F) for first in firsts]
            scales = [block_scales(builder, wa.data, tile, f, r) for r in range(ROWS)]
            fold_pairs(builder, fma, f, iacc, scales, dx, xsum_, accs)
        store_pairs(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, out, t0, n0, qtype, pairs), codegen


def twice(builder, v):
    """An 8-lane vector in both halves of a 16-lane one."""
    return builder.shuffle_vector(v, v, TWICE)


def fold_pairs(builder, fma, f, iacc, scales, dx, xsum, accs):
    """accs[r][p] += a group's sums iacc[r][p] of row r and pair p, scaled as kquant.py folds them (in its
    order): scales[r] = (S, M) of the row's blocks (8 lanes), dx and xsum [P] the pairs' activation scales
    and block sums (16 lanes)."""
    xsum_f = [builder.sitofp(s, V16F) for s in xsum] if f.has_min else None
    for r, (s, m) in enumerate(scales):
        s2 = twice(builder, s)
        minus_m2 = twice(builder, builder.fneg(m)) if f.has_min else None
        for p, sums in enumerate(iacc[r]):
            acc = builder.load(accs[r][p])
            if f.has_min:  # fma(dx, fma(-M, xsum, S x dot), acc)
                scaled = builder.fmul(s2, builder.sitofp(sums, V16F))
                inner = builder.call(fma, [minus_m2, xsum_f[p], scaled])
                acc = builder.call(fma, [dx[p], inner, acc])
            else:  # int8.fold_group's: fma(dot, S x dx, acc)
                acc = builder.call(fma, [builder.sitofp(sums, V16F), builder.fmul(s2, dx[p]), acc])
            builder.store(acc, accs[r][p])
