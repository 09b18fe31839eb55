"""What the host CPU can run, as LLVM sees it (numba compiles for the host), with a way to pretend less, and
its L2 cache's size (/sys).

NUMASERVE_DISABLE_CPU_FEATURES=avx2,f16c (comma-separated LLVM feature names) hides features, so a
machine without them can be simulated: kernels that need them are then not used (and say why).
"""

import os
from pathlib import Path

from llvmlite import binding

CPU_ROOT = Path("/sys/devices/system/cpu")


def cpu_features() -> frozenset[str]:
    flags = binding.get_host_cpu_features().flatten().split(",")
    present = {f[1:] for f in flags if f.startswith("+")}
    hidden = {f.strip() for f in os.environ.get("NUMASERVE_DISABLE_CPU_FEATURES", "").split(",") if f.strip()}
    return frozenset(present - hidden)


def missing_features(needed: tuple[str, ...]) -> list[str]:
    have = cpu_features()
    return [f for f in needed if f not in have]


def l2_cache(root: Path = CPU_ROOT) -> tuple[int, int] | None:
    """(cpu id, bytes) of the L2 of the first core this process may run on, from
    /sys/devices/system/cpu/cpu<id>/cache/index*/ (level 2, Unified or Data); None where /sys does not say."""
    cpu_id = min(os.sched_getaffinity(0))
    for index in sorted((root / f"cpu{cpu_id}" / "cache").glob("index[0-9]*")):
        try:
            level, kind, size = ((index / name).read_text().strip() for name in ("level", "type", "size"))
        except OSError:
            continue
        if level == "2" and kind in ("Unified", "Data"):
            return cpu_id, _size_bytes(size)
    return None


def _size_bytes(text: str) -> int:
    """'1024K' | '2M' | '512' (sysfs cache sizes) -> bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale
