"""Register-resident dot-product loops: how many multiply-adds per second this CPU's vector units give for
the instructions the kernels are built on, with no memory in the way.

A loop keeps NUM_ACCS independent accumulators (enough chains to cover the instruction's latency on two
ports) and feeds each, every iteration, the same two operand vectors held in registers: per iteration
NUM_ACCS instructions, each a fixed number of multiply-adds (`Instruction.macs`). Chain c starts at c in
every lane, so no two chains are the same expression (which LLVM would compute once). One operation = one
multiply or one add, so a multiply-add counts 2, as a GEMM's 2 x M x N x K counts.

    int8  vpdpbusd (AVX512-VNNI; 256 or 512 bits): unsigned x signed bytes, 4 products summed into an int32
          lane; without VNNI, vpmaddwd (AVX2): int16 pairs, both products summed into an int32 lane, the
          instruction kernels/simd/int8.py is built on there (its chain feeds each result back as the next
          int16 operand: with a loop-invariant operand pair LLVM would hoist it out of the loop)
    bf16  vdpbf16ps (AVX512-BF16): bf16 pairs, both products added into a float32 lane
    f32   vfmadd (FMA / AVX-512F)

The result (the accumulators' sum, stored to `out`) is exact for small operands, so a test checks that the
loop runs the instructions it is said to run (tests/benchmarks/test_peak_kernels.py).
"""

import time
from dataclasses import dataclass

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

I32, F32 = ir.IntType(32), ir.FloatType()


@dataclass(frozen=True)
class Instruction:
    kind: str  # "int8" | "bf16" | "f32": the activation dtype whose kernels it bounds
    name: str  # as the manuals spell it
    bits: int  # vector width
    features: tuple[str, ...]  # LLVM's names of what it needs
    macs: int  # multiply-adds per instruction

    @property
    def lanes(self) -> int:
        return self.bits // 32

    @property
    def label(self) -> str:
        return f"{self.kind} {self.name} {self.bits}-bit"


INSTRUCTIONS = (
    Instruction("int8", "vpdpbusd", 512, ("avx512vnni",), 64),
    Instruction("int8", "vpdpbusd", 256, ("avx512vnni", "avx512vl"), 32),
    Instruction("int8", "vpmaddwd", 256, ("avx2",), 16),
    Instruction("bf16", "vdpbf16ps", 512, ("avx512bf16",), 32),
    Instruction("bf16", "vdpbf16ps", 256, ("avx512bf16", "avx512vl"), 16),
    Instruction("f32", "vfmadd", 512, ("avx512f",), 16),
    Instruction("f32", "vfmadd", 256, ("fma",), 8),
)
OPERAND_BYTES = 64  # each of the two operands: one 512-bit vector (a 256-bit loop reads its first half)


def num_accs() -> int:
    """Independent chains per loop: 16 with AVX-512's 32 vector registers, 12 with AVX2's 16 (two hold the
    operands)."""
    from kernels.simd.cpu import missing_features

    return 16 if not missing_features(("avx512f",)) else 12


def available() -> list[Instruction]:
    # imported here: `kernels` pins numba's threading layer when imported, and a benchmark's parent chooses
    # its own layer first (bench_decode restarts itself if it finds the engine's modules imported)
    from kernels.simd.cpu import missing_features

    return [i for i in INSTRUCTIONS if not missing_features(i.features)]


def _step_function(module, ins: Instruction):
    """(acc, a, b) -> acc + a . b, one instruction, and the accumulator's type."""
    from kernels.simd.int8 import fma_function  # the kernels' own declarations (imported here: see available)
    from kernels.simd.vnni import dpbusd_function

    n = ins.lanes
    vi, vf = ir.VectorType(I32, n), ir.VectorType(F32, n)
    if ins.name == "vpdpbusd":
        fn = dpbusd_function(module, ins.bits)
        return (lambda b, acc, x, y: b.call(fn, [acc, x, y])), vi
    if ins.name == "vpmaddwd":  # acc <- pmaddwd(acc as int16 pairs, y); x unused
        v16 = ir.VectorType(ir.IntType(16), 2 * n)
        fn = cgutils.get_or_insert_function(module, ir.FunctionType(vi, [v16, v16]), "llvm.x86.avx2.pmadd.wd")
        return (lambda b, acc, x, y: b.call(fn, [b.bitcast(acc, v16), b.bitcast(y, v16)])), vi
    if ins.name == "vdpbf16ps":
        fn = cgutils.get_or_insert_function(module, ir.FunctionType(vf, [vf, vi, vi]),
                                            f"llvm.x86.avx512bf16.dpbf16ps.{ins.bits}")
        return (lambda b, acc, x, y: b.call(fn, [acc, x, y])), vf
    fn = fma_function(module, n)
    return (lambda b, acc, x, y: b.call(fn, [b.bitcast(x, vf), b.bitcast(y, vf), acc])), vf


@intrinsic(prefer_literal=True)
def dot_loop(typingctx, operands, out, iterations, index, accs):
    """out[:bits / 8] = the sum of `accs` chains after `iterations` rounds of acc <- acc + a . b with
    INSTRUCTIONS[index] (vpmaddwd: acc <- acc . b), a and b the first bits / 8 bytes of operands[0] and
    operands[1], chain c starting at c in every lane.

    operands: [2, 64] uint8, out: [64] uint8 (int32 or float32 lanes, as the instruction's), index and
    accs: literals."""
    if not (isinstance(operands, types.Array) and operands.ndim == 2 and operands.dtype == types.uint8
            and isinstance(out, types.Array) and out.ndim == 1 and out.dtype == types.uint8):
        return None
    if not all(isinstance(a, types.IntegerLiteral) for a in (index, accs)):
        return None
    ins, count = INSTRUCTIONS[index.literal_value], accs.literal_value

    def codegen(context, builder, signature, args):
        ops, dst = (context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:2], args[:2]))
        step, acc_type = _step_function(builder.module, ins)
        vi = ir.VectorType(I32, ins.lanes)
        x, y = (builder.load(builder.bitcast(builder.gep(ops.data, [ir.Constant(ir.IntType(64), k)]),
                                             vi.as_pointer()), align=1) for k in (0, OPERAND_BYTES))
        chains = [cgutils.alloca_once_value(builder, ir.Constant(acc_type, [c] * ins.lanes))
                  for c in range(count)]
        n = context.cast(builder, args[2], signature.args[2], types.int64)
        with cgutils.for_range(builder, n):
            for chain in chains:
                builder.store(step(builder, builder.load(chain), x, y), chain)
        add = builder.add if acc_type.element == I32 else builder.fadd
        total = builder.load(chains[0])
        for chain in chains[1:]:
            total = add(total, builder.load(chain))
        builder.store(total, builder.bitcast(dst.data, acc_type.as_pointer()), align=1)
        return context.get_dummy_value()

    return types.none(operands, out, iterations, index, accs), codegen


def loop_functions(ins: Instruction, accs: int):
    """(one, every): one(operands, out[64], iterations) runs the loop on the calling thread;
    every(operands, out[threads, 64], iterations) runs it once on each of numba's threads."""
    index = INSTRUCTIONS.index(ins)

    @njit(nogil=True)
    def one(operands, out, iterations):
        dot_loop(operands, out, iterations, index, accs)

    @njit(nogil=True, parallel=True)
    def every(operands, out, iterations):
        for t in prange(out.shape[0]):
            dot_loop(operands, out[t], iterations, index, accs)

    return one, every


def probe_operands(ins: Instruction) -> np.ndarray:
    """[2, 64] bytes of ordinary operands: bytes 1 for the integer loops (their lanes wrap, at no cost), bf16
    or float32 1.0 and 0.5 for the float ones (no denormal ever, no overflow in billions of rounds)."""
    if ins.kind == "int8":
        return np.ones((2, OPERAND_BYTES), np.uint8)
    values = np.array([[1.0], [0.5]], np.float32).repeat(16, 1)
    if ins.kind == "bf16":
        return (values.view(np.uint32) >> 16).astype(np.uint16).repeat(2, 1).view(np.uint8)
    return values.view(np.uint8)


class DotPeak:
    """One instruction's loop, compiled, sized to run about `seconds`, timed on one thread or on numba's
    threads (one loop each): operations per second (a multiply-add counts 2)."""

    def __init__(self, ins: Instruction, seconds: float = 0.1):
        self.ins, self.accs = ins, num_accs()
        self.one, self.every = loop_functions(ins, self.accs)
        self.operands = probe_operands(ins)
        self.out = np.zeros((numba.get_num_threads(), OPERAND_BYTES), np.uint8)
        trial = 1 << 16
        self.one(self.operands, self.out[0], 1)
        self.every(self.operands, self.out, 1)
        self.iterations = max(trial, int(trial * seconds / _timed(lambda: self.one(self.operands, self.out[0],
                                                                                  trial))))

    def ops_per_s(self, all_threads: bool) -> float:
        if all_threads:
            seconds = _timed(lambda: self.every(self.operands, self.out, self.iterations))
        else:
            seconds = _timed(lambda: self.one(self.operands, self.out[0], self.iterations))
        threads = len(self.out) if all_threads else 1
        return 2 * self.ins.macs * self.accs * self.iterations * threads / seconds


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
