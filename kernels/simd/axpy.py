"""weighted_sum(w, x, a, b, out): out[d] += w[j] * x[j, d] for j = a .. b - 1 in order, one fused
multiply-add a term, written as LLVM IR: the accumulators of up to 64 values of out stay in registers over
the whole run of j, where numba's loop loaded and stored out[] for every j. Each out[d] gets the bits of the
loop `for j: out[d] += w[j] * x[j, d]` compiled with contraction (kernels/attention/chunks.py's value sums):
splitting d into vectors changes no element's order.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kernels.simd.int8 import fma_function

_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V8F = ir.VectorType(_F32, 8)
_ZEROS8 = ir.Constant(ir.VectorType(_I32, 8), [0] * 8)  # a shuffle mask: lane 0 to all eight


@intrinsic
def weighted_sum(typingctx, w, x, a, b, out):
    """w: [W] float32; x: [N, D] float32; out: [D] float32, all C-contiguous; a, b: the rows of x (and
    entries of w) summed."""
    arrays = ((w, 1), (x, 2), (out, 1))
    if not all(isinstance(arr, types.Array) and arr.ndim == nd and arr.dtype == types.float32
               and arr.layout == "C" for arr, nd in arrays) or not all(isinstance(i, types.Integer)
                                                                      for i in (a, b)):
        return None

    def codegen(context, builder, signature, args):
        wa, xa, oa = (context.make_array(ty)(context, builder, value)
                      for ty, value in zip((signature.args[0], signature.args[1], signature.args[4]),
                                           (args[0], args[1], args[4])))
        first, stop = (context.cast(builder, args[i], signature.args[i], types.int64) for i in (2, 3))
        D = cgutils.unpack_tuple(builder, xa.shape, 2)[1]
        module = builder.module
        fma = fma_function(module)
        fma1 = cgutils.get_or_insert_function(module, ir.FunctionType(_F32, [_F32] * 3), "llvm.fma.f32")

        def vec_ptr(ptr, i):
            return builder.bitcast(builder.gep(ptr, [i]), _V8F.as_pointer())

        d = cgutils.alloca_once_value(builder, ir.Constant(_I64, 0))

        def columns(n: int):  # while n vectors of columns are left: their sums over j; d += 8 n
            check, body, done = (builder.append_basic_block(f"wsum{n}.{part}")
                                 for part in ("check", "body", "done"))
            builder.branch(check)
            builder.position_at_end(check)
            d0 = builder.load(d)
            fits = builder.icmp_signed("<=", builder.add(d0, ir.Constant(_I64, 8 * n)), D)
            builder.cbranch(fits, body, done)
            builder.position_at_end(body)
            offsets = [builder.add(d0, ir.Constant(_I64, 8 * v)) for v in range(n)]
            accs = [cgutils.alloca_once(builder, _V8F) for _ in range(n)]
            for acc, off in zip(accs, offsets):
                builder.store(builder.load(vec_ptr(oa.data, off), align=1), acc)
            with cgutils.for_range_slice(builder, first, stop, ir.Constant(_I64, 1)) as (j, _):
                wj = builder.load(builder.gep(wa.data, [j]))
                one = builder.insert_element(ir.Constant(_V8F, None), wj, ir.Constant(_I32, 0))
                splat = builder.shuffle_vector(one, ir.Constant(_V8F, None), _ZEROS8)
                row = builder.mul(j, D)
                for acc, off in zip(accs, offsets):
                    xv = builder.load(vec_ptr(xa.data, builder.add(row, off)), align=1)
                    builder.store(builder.call(fma, [splat, xv, builder.load(acc)]), acc)
            for acc, off in zip(accs, offsets):
                builder.store(builder.load(acc), vec_ptr(oa.data, off), align=1)
            builder.store(builder.add(d0, ir.Constant(_I64, 8 * n)), d)
            builder.branch(check)
            builder.position_at_end(done)

        for n in (8, 4, 2, 1):
            columns(n)
        with cgutils.for_range_slice(builder, builder.load(d), D, ir.Constant(_I64, 1)) as (col, _):
            acc = cgutils.alloca_once_value(builder, builder.load(builder.gep(oa.data, [col])))
            with cgutils.for_range_slice(builder, first, stop, ir.Constant(_I64, 1)) as (j, _):
                xj = builder.load(builder.gep(xa.data, [builder.add(builder.mul(j, D), col)]))
                wj = builder.load(builder.gep(wa.data, [j]))
                builder.store(builder.call(fma1, [wj, xj, builder.load(acc)]), acc)
            builder.store(builder.load(acc), builder.gep(oa.data, [col]))
        return context.get_dummy_value()

    return types.none(w, x, a, b, out), codegen
