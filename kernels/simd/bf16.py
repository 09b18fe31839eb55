"""A register block for bf16 activations x bf16 weights through AVX512-BF16, written as LLVM IR: 4 weight rows
x TB tokens.

`vdpbf16ps` multiplies 32 bf16 pairs and adds each pair's two products into a float32 lane (16 lanes, 32
multiply-adds per 512-bit instruction, twice float32 FMA's, and no widening of the weights first). Lane l
of an accumulator gathers values 2l and 2l + 1 of every 32; at the end the upper 8 lanes are added to the
lower 8 and one horizontal sum gives a (row, token) its dot product, in the same order whatever the other rows
and tokens are (batch invariance).

Weights are row-major, rows padded to whole blocks of 4 and K to whole groups of GROUP values with zeros
(pack_bf16 below); activations are padded to the same Kp. A block of 2 or more tokens reads its 4 rows side
by side, each stream prefetched as the VNNI kernel's (kernels/simd/vnni.py prefetch_ahead); a 1-token block
reads them one after another, one sequential stream left to the hardware prefetcher, which on Zen 4 read
faster than the 4 rows interleaved by group as the int8 layouts are (benchmarks/results/HISTORY.md, "bf16
weights row-major"). A 1-token block's (row, token) is one chain of dependent vdpbf16ps: on 256-bit vectors
that chain, not the memory, bounded its read; a 512-bit link carries twice the bytes (HISTORY "bf16 on
512-bit vectors"). Either walk adds a (row, token)'s products in the same order: the same bits. Rows past the
matrix's last (padding of the last block) are computed, not stored.

Needs AVX512-BF16 and AVX512F (the 512-bit vdpbf16ps). numba's on-disk cache of kernels/linear/bf16.py
does not notice edits to this file: after changing the code generation here, delete kernels/__pycache__.
"""

from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import F32, I32, const64, load_vec, operands_fit, store_block
from kernels.simd.vnni import prefetch_ahead

BF16_FEATURES = ("avx512bf16", "avx512f")
ROWS = 4  # weight rows per block
GROUP = 128  # values of a row per group (256 bytes): rows are padded to whole groups, walked a group a step
VECTORS = GROUP // 32  # 32 bf16 values per 512-bit vector
V16F, V16I = ir.VectorType(F32, 16), ir.VectorType(I32, 16)


@intrinsic(prefer_literal=True)
def bf16_block(typingctx, xb, w, out, t0, n0, tokens):
    """out[t0:t0+tokens, n0:n0+4] = dot products of bf16 activations with 4 packed bf16 weight rows
    (those < N).

    xb: [T, Kp] uint16 (bf16 bits), w: [N4, Kp] uint16 in 4-row blocks (pack_bf16), out: [T, N] f32;
    n0 % 4 == 0; tokens: a literal.
    """
    if not operands_fit((xb, w, out), (types.uint16, types.uint16, types.float32)):
        return None
    if not isinstance(tokens, types.IntegerLiteral):
        return None
    TB = tokens.literal_value
    group_bytes = 2 * GROUP

    def codegen(context, builder, signature, args):
        xa, wa, oa = (context.make_array(ty)(context, builder, value)
                      for ty, value in zip(signature.args[:3], args[:3]))
        t0_, n0_ = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (3, 4))
        Kp = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        N = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        num_groups = builder.udiv(Kp, const64(GROUP))
        module = builder.module
        # the bf16 operands typed <16 x i32>, the form every LLVM since AVX512-BF16's introduction accepts
        dpbf16 = cgutils.get_or_insert_function(module, ir.FunctionType(V16F, [V16F, V16I, V16I]),
                                                "llvm.x86.avx512bf16.dpbf16ps.512")
        token_rows = [builder.add(t0_, const64(t)) for t in range(TB)]
        weight_rows = [builder.add(n0_, const64(r)) for r in range(ROWS)]
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(V16F, None)) for _ in range(TB)]
                for _ in range(ROWS)]

        def walk(rows):
            """Every group of these weight rows (side by side) against the block's tokens."""
            with cgutils.for_range(builder, num_groups) as loop:
                k = builder.mul(loop.index, const64(GROUP))
                streams = {r: builder.add(builder.mul(weight_rows[r], Kp), k) for r in rows}  # in values
                if len(rows) > 1:  # one row's stream alone is the hardware prefetcher's
                    for r in rows:
                        prefetch_ahead(builder, wa.data, builder.mul(streams[r], const64(2)), group_bytes, TB)
                x_base = [builder.add(builder.mul(row, Kp), k) for row in token_rows]
                sums = {(r, t): builder.load(accs[r][t]) for r in rows for t in range(TB)}
                for j in range(VECTORS):
                    weights = {r: load_vec(builder, wa.data, builder.add(streams[r], const64(32 * j)), V16I)
                               for r in rows}
                    for t in range(TB):
                        xv = load_vec(builder, xa.data, builder.add(x_base[t], const64(32 * j)), V16I)
                        for r in rows:
                            sums[r, t] = builder.call(dpbf16, [sums[r, t], weights[r], xv])
                for (r, t), value in sums.items():
                    builder.store(value, accs[r][t])

        if TB == 1:
            for r in range(ROWS):
                walk([r])
        else:
            walk(range(ROWS))
        store_block(builder, oa.data, accs, token_rows, weight_rows, N)
        return context.get_dummy_value()

    return types.none(xb, w, out, t0, n0, tokens), codegen


@njit(cache=True, nogil=True, parallel=True)
def pack_bf16(src, out):
    # src: [N, K] uint16 bf16 -> out: [N4, Kp] uint16 (zeroed): row-major, the padding left zero
    K = src.shape[1]
    for n in prange(src.shape[0]):
        out[n, :K] = src[n]
