"""What the host CPU can run, as LLVM sees it (numba compiles for the host), with a way to pretend less.

NUMASERVE_DISABLE_CPU_FEATURES=avx2,f16c (comma-separated LLVM feature names) hides features, so a
machine without them can be simulated: kernels that need them are then not used (and say why).
"""

import os

from llvmlite import binding


def cpu_features() -> frozenset[str]:
    flags = binding.get_host_cpu_features().flatten().split(",")
    present = {f[1:] for f in flags if f.startswith("+")}
    hidden = {f.strip() for f in os.environ.get("NUMASERVE_DISABLE_CPU_FEATURES", "").split(",") if f.strip()}
    return frozenset(present - hidden)


def missing_features(needed: tuple[str, ...]) -> list[str]:
    have = cpu_features()
    return [f for f in needed if f not in have]
