"""kernels/simd/vnni.py's register block on 512-bit vectors: 4 weight rows x 2P tokens (P pairs), a vector
holding two tokens' 8 lanes each.

As in vnni.py, per group of 8 blocks each (row, token) pair keeps 8 int32 lanes, lane b = block b, filled by
vpdpbusd over the group's 8 vectors (weights the unsigned side); here a 512-bit accumulator holds the pairs
(row, t) and (row, t + 1) side by side: the weight vector is broadcast to both halves, and the activations
come paired (kernels/formats/token_pairs.py), so one 64-byte load gives both tokens' vector and one their
scales or block sums. One vpdpbusd does 64 products where vnni.py's does 32, and no activation vector is
shuffled (each weight vector's broadcast remains). 3 pairs (6 tokens: 12 int32 and 12 float32 accumulators, 4
weight vectors and one of activations in the 32 registers) ran 1.19x (q8_0) and 1.20x (q4_0) faster than 2
pairs of unpaired tokens (each pair of vectors joined by a shuffle), 2 and 4 pairs slower than 3
(benchmarks/results/HISTORY.md, 2026-12-02). Every lane sees the same integer sums, the same fold (convert,
scale = weight scale x activation scale, fused multiply-add) and the same horizontal sum per (row, token) as
vnni.py: the outputs are its bits. The fold's multiply and fused multiply-add share the dot products' units: 2
a group per pair and row against 8 vpdpbusd, so this block cannot pass ~80% of the vpdpbusd peak.

Needs AVX512-VNNI and AVX512F (the 512-bit vpdpbusd) and F16C. numba's on-disk cache of
kernels/linear/int8.py does not notice edits to this file: after changing the code generation here,
delete kernels/__pycache__.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import (
    F32,
    GROUP,
    I32,
    V8F,
    V8I,
    block_operands,
    const64,
    fma_function,
    group_counts,
    hsum8,
    load_vec,
)
from kernels.simd.vnni import (
    ROWS,
    V32I8,
    dpbusd_function,
    nibble_vector,
    prefetch_ahead,
    vnni_literals,
)

V16I, V16F = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
TWICE = ir.Constant(ir.VectorType(I32, 16), list(range(8)) * 2)  # an 8-lane vector in both halves
HALVES = [ir.Constant(ir.VectorType(I32, 8), list(range(h * 8, h * 8 + 8))) for h in range(2)]


@intrinsic(prefer_literal=True)
def vnni_block_wide(typingctx, xq, xd, xsum, data, scales, out, t0, n0, bits, pairs):
    """out[t0:t0+2*pairs, n0:n0+4] = the int8 dot products of quantized x with 4 packed W rows (those < N).

    Operands as kernels/simd/vnni.vnni_block's, with xq, xd, xsum paired (kernels/formats/token_pairs.py) and
    t0 the first row of a pair; bits (8 | 4), pairs: literals.
    """
    literals = vnni_literals((xq, xd, xsum, data, scales, out), bits, pairs)
    if literals is None:
        return None
    is_q4, P, offset, group_bytes = literals

    def codegen(context, builder, signature, args):
        (xa, da, sa, wa, ca, oa), t0_, n0_, Kp, N = block_operands(context, builder, signature, args)
        num_blocks, num_groups = group_counts(builder, Kp)
        module = builder.module
        dpbusd = dpbusd_function(module, 512)
        fma = fma_function(module, 16)
        minus_offset = ir.Constant(V16I, [-offset] * 16)
        token_rows = [builder.add(t0_, const64(t)) for t in range(2 * P)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        block_base = builder.mul(builder.udiv(n0_, const64(ROWS)), num_groups)  # the block's first group
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, None)) for _ in range(P)]
                for _ in range(ROWS)]

        with cgutils.for_range(builder, num_groups) as loop:
            g = loop.index
            blk0 = builder.mul(g, const64(8))
            x_base = [pair_group(builder, token_rows[2 * p], Kp, g, GROUP) for p in range(P)]
            # this group's 4 rows
            stream = builder.mul(builder.add(block_base, g), const64(ROWS * group_bytes))
            prefetch_ahead(builder, wa.data, stream, ROWS * group_bytes, 2 * P)
            w_base = [builder.add(stream, const64(r * group_bytes)) for r in range(ROWS)]
            dx = [paired_blocks(builder, da.data, token_rows[2 * p], num_blocks, g, V16F) for p in range(P)]
            dw = [builder.fpext(load_vec(builder, ca.data, builder.add(builder.mul(row, num_blocks), blk0),
                                         ir.VectorType(ir.HalfType(), 8)), V8F) for row in weight_rows]
            dw = [builder.shuffle_vector(d, d, TWICE) for d in dw]
            init = [builder.mul(paired_blocks(builder, sa.data, token_rows[2 * p], num_blocks, g, V16I),
                                minus_offset) for p in range(P)]
            iacc = [list(init) for _ in range(ROWS)]
            packed = [None] * ROWS
            for j in range(8):
                weights = weight_vectors(builder, wa.data, w_base, j, is_q4, packed)
                for p in range(P):
                    xv = load_vec(builder, xa.data, builder.add(x_base[p], const64(64 * j)), V16I)
                    for r in range(ROWS):
                        iacc[r][p] = builder.call(dpbusd, [iacc[r][p], weights[r], xv])
            for r in range(ROWS):
                for p in range(P):
                    scale = builder.fmul(dw[r], dx[p])
                    builder.store(builder.call(fma, [builder.sitofp(iacc[r][p], V16F), scale,
                                                     builder.load(accs[r][p])]), accs[r][p])
        store_pairs(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xq, xd, xsum, data, scales, out, t0, n0, bits, pairs), codegen


def pair_group(builder, first_row, row_values, g, group_values):
    """Where group g (group_values a row) of the pair whose first row is first_row starts in a paired array
    of row_values a row (kernels/formats/token_pairs.py)."""
    return builder.add(builder.mul(first_row, row_values), builder.mul(g, const64(2 * group_values)))


def paired_blocks(builder, array, first_row, num_blocks, g, vec_type):
    """Group g's 8 block values (xd or xsum: num_blocks a row) of both rows of a pair, one load."""
    return load_vec(builder, array, pair_group(builder, first_row, num_blocks, g, 8), vec_type)


def weight_vectors(builder, data, w_base, j, is_q4, packed):
    """Vector j of the group of each of the 4 rows (q4_0: from its chunk, loaded into packed[r] at even j),
    in both halves of a 512-bit vector."""
    weights = []
    for r in range(ROWS):
        if is_q4:
            if j % 2 == 0:
                packed[r] = load_vec(builder, data, builder.add(w_base[r], const64(16 * j)), V32I8)
            v = builder.bitcast(nibble_vector(builder, packed[r], j), V8I)
        else:
            v = load_vec(builder, data, builder.add(w_base[r], const64(32 * j)), V8I)
        weights.append(builder.shuffle_vector(v, v, TWICE))
    return weights


def store_pairs(builder, out_data, accs, token_rows, weight_rows, N):
    """out[token, row] = the horizontal sum of its half of accs[r][p] (tokens 2p, 2p + 1), rows < N."""
    for r, row in enumerate(weight_rows):
        with builder.if_then(builder.icmp_signed("<", row, N), likely=True):
            for p, pair_accs in enumerate(accs[r]):
                acc = builder.load(pair_accs)
                for h in range(2):
                    ptr = builder.gep(out_data, [builder.add(builder.mul(token_rows[2 * p + h], N), row)])
                    builder.store(hsum8(builder, builder.shuffle_vector(acc, acc, HALVES[h])), ptr)
