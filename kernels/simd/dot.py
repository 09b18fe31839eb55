"""dot(a, b) of two float32 vectors in one fixed order, written as LLVM IR; dots(), the same for each row of a
matrix against one vector.

Eight lanes (lane l takes elements l, l + 8, l + 16, ...) accumulated with fused multiply-adds, then a
pairwise horizontal sum, then the D % 8 tail in order. The same bits wherever it is inlined: numba's fastmath
sums (`reassoc`) let LLVM pick a vectorization per call site, so the serial and the parallel attention kernel
summed the same scores differently (batch invariance, models/linear.py); without `reassoc` LLVM left the
scalar loop unvectorized.

dots() gives each row the bits dot() gives it, with up to BLOCK rows' accumulators advanced together: one dot
is a chain of D / 8 dependent fused multiply-adds (4 cycles each), so a query-head group's scores one row at a
time waited on latency.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import fma_function, hsum8

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V8F = ir.VectorType(_F32, 8)
BLOCK = 8  # rows whose chains interleave: FMA latency 4 x 2 issued per cycle


def _emit_dots(builder, a_rows: list, b_data, D):
    """The IR of sum(a * b) for each pointer in a_rows (float32*, D values each) against b_data -> float
    values."""
    module = builder.module
    fma = fma_function(module)
    fma1 = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")

    def load8(ptr, i):
        return builder.load(builder.bitcast(builder.gep(ptr, [i]), _V8F.as_pointer()), align=1)

    eight = ir.Constant(_I64, 8)
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_V8F, None)) for _ in a_rows]
    with cgutils.for_range(builder, builder.udiv(D, eight)) as loop:
        i = builder.mul(loop.index, eight)
        bv = load8(b_data, i)
        for a, acc in zip(a_rows, accs):
            builder.store(builder.call(fma, [load8(a, i), bv, builder.load(acc)]), acc)
    # 8 -> 4 -> 2 -> 1, eight rows' sums together when there are eight
    sums = (_hsum8x8(builder, [builder.load(acc) for acc in accs]) if len(accs) == 8
            else [hsum8(builder, builder.load(acc)) for acc in accs])
    totals = [cgutils.alloca_once_value(builder, total) for total in sums]
    with cgutils.for_range_slice(builder, builder.mul(builder.udiv(D, eight), eight), D,
                                 ir.Constant(_I64, 1)) as (i, _):
        y = builder.load(builder.gep(b_data, [i]))
        for a, total in zip(a_rows, totals):
            builder.store(builder.call(fma1, [builder.load(builder.gep(a, [i])), y, builder.load(total)]),
                          total)
    return [builder.load(total) for total in totals]


def _hsum8x8(builder, vecs: list) -> list:
    """hsum8 of eight vectors, each with hsum8's pairings (lane i + lane i + 4, then + 2, then + 1), as a
    tree of two-vector shuffles: 7 vector adds and 14 shuffles where eight hsum8 take 24 and 48 (decode
    attention's scores: eight query heads against one key row)."""
    def lanes(x, y, which: list):  # x's lanes which, then y's
        mask = ir.Constant(ir.VectorType(_I32, 8), which + [8 + i for i in which])
        return builder.shuffle_vector(x, y, mask)

    def pair(x, y, lo: list, hi: list):
        return builder.fadd(lanes(x, y, lo), lanes(x, y, hi))

    # [a0 + a4, a1 + a5, a2 + a6, a3 + a7] of each vector, two vectors a result
    fours = [pair(vecs[i], vecs[i + 1], [0, 1, 2, 3], [4, 5, 6, 7]) for i in range(0, 8, 2)]
    # [c0 + c2, c1 + c3] of each vector, four a result
    twos = [pair(fours[i], fours[i + 1], [0, 1, 4, 5], [2, 3, 6, 7]) for i in range(0, 4, 2)]
    ones = pair(twos[0], twos[1], [0, 2, 4, 6], [1, 3, 5, 7])  # vector r's sum in lane r
    return [builder.extract_element(ones, ir.Constant(_I32, r)) for r in range(8)]


@intrinsic
def dot(typingctx, a, b):
    """sum(a * b) for a, b: [D] float32, C-contiguous, same length."""
    if not all(isinstance(x, types.Array) and x.ndim == 1 and x.dtype == types.float32 and x.layout == "C"
               for x in (a, b)):
        return None

    def codegen(context, builder, signature, args):
        aa, ba = (context.make_array(ty)(context, builder, value) for ty, value in zip(signature.args, args))
        D = cgutils.unpack_tuple(builder, aa.shape, 1)[0]
        return _emit_dots(builder, [aa.data], ba.data, D)[0]

    return types.float32(a, b), codegen


@intrinsic
def dots(typingctx, a, b, out, column, scale):
    """out[g, column] = dot(a[g], b) * scale for every row g: a [G, D], b [D], out [G, W] float32,
    C-contiguous; scale float32."""
    arrays = ((a, 2), (b, 1), (out, 2))
    if not all(isinstance(x, types.Array) and x.ndim == nd and x.dtype == types.float32 and x.layout == "C"
               for x, nd in arrays) or scale != types.float32 or not isinstance(column, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        aa, ba, oa = (context.make_array(ty)(context, builder, value)
                      for ty, value in zip(signature.args[:3], args[:3]))
        col = context.cast(builder, args[3], signature.args[3], types.int64)
        G, D = cgutils.unpack_tuple(builder, aa.shape, 2)
        W = cgutils.unpack_tuple(builder, oa.shape, 2)[1]
        g = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))

        def rows(n: int):  # while n rows are left: their dots, stored; g += n
            check, body, done = (builder.append_basic_block(f"dots{n}.{part}")
                                 for part in ("check", "body", "done"))
            builder.branch(check)
            builder.position_at_end(check)
            g0 = builder.load(g)
            builder.cbranch(builder.icmp_signed("<=", builder.add(g0, ir.Constant(_I64, n)), G), body, done)
            builder.position_at_end(body)
            firsts = [builder.add(g0, ir.Constant(_I64, r)) for r in range(n)]
            totals = _emit_dots(builder, [builder.gep(aa.data, [builder.mul(f, D)]) for f in firsts],
                                ba.data, D)
            for f, total in zip(firsts, totals):
                builder.store(builder.fmul(total, args[4]),
                              builder.gep(oa.data, [builder.add(builder.mul(f, W), col)]))
            builder.store(builder.add(g0, ir.Constant(_I64, n)), g)
            builder.branch(check)
            builder.position_at_end(done)

        for n in (BLOCK, BLOCK // 2, 1):
            rows(n)
        return context.get_dummy_value()

    return types.none(a, b, out, column, scale), codegen
