"""numba kernels: pure functions over preallocated arrays. No state, no classes.

Importing this package pins numba's threading layer, before any kernel module runs a parallel region. numba's
default, the OpenMP layer, runs on whichever libgomp the process loaded first: with `import torch` before
numaserve that is torch's copy, initialized before we could choose its wait policy, and its spinning threads
made a generate on a loaded machine many times slower. Neither the OpenMP runtime nor its wait policy can be
chosen after another library loaded it, so we take a layer no other library initializes: TBB, from the `tbb`
wheel, else numba's own `workqueue`.

TBB spins briefly, then sleeps: it is close to spinning OpenMP on idle cores, the fastest when the cores are
shared, and the same whatever was imported first; workqueue is slower per small step (each region wakes its
threads through a condition variable). The measurements are in benchmarks/results/HISTORY.md. A
NUMBA_THREADING_LAYER set by the user is respected (and recorded), e.g. `omp` with OMP_WAIT_POLICY=ACTIVE on
dedicated cores, which `numaserve bench` measures.
"""

import ctypes
import os
import re
from collections.abc import Collection
from importlib import metadata

import numba
from numba.np.ufunc import parallel as _numba_parallel

_TBB_MIN_INTERFACE = 12060  # numba's own floor (oneTBB 2021.6)


def _load_tbb() -> str | None:
    """Load libtbb from the `tbb` wheel so numba finds it (pip puts it in <venv>/lib, off the loader's path).

    -> None if it loaded, else why not."""
    try:
        files = metadata.files("tbb") or []
    except metadata.PackageNotFoundError:
        return "the tbb package is not installed (pip install tbb)"
    libs = [f for f in files if re.fullmatch(r"libtbb\.so\.\d+", f.name)]
    if not libs:
        return "the tbb package has no libtbb.so"
    try:
        lib = ctypes.CDLL(str(libs[0].locate()), mode=ctypes.RTLD_GLOBAL)
    except OSError as e:
        return f"libtbb did not load: {e}"
    if lib.TBB_runtime_interface_version() < _TBB_MIN_INTERFACE:
        return "libtbb is older than numba's minimum (2021.6)"
    return None


def _libgomp_loaded() -> bool:
    with open("/proc/self/maps") as maps:
        return "libgomp" in maps.read()


def _pin_threading_layer() -> tuple[str, str]:
    """Set numba's threading layer (before its threads start); -> (requested layer, why)."""
    if _numba_parallel._is_initialized:
        return numba.config.THREADING_LAYER, "numba's threads had started before numaserve was imported"
    if os.environ.get("NUMBA_THREADING_LAYER"):
        if numba.config.THREADING_LAYER == "omp":
            os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read once, when libgomp loads
        return numba.config.THREADING_LAYER, "set by NUMBA_THREADING_LAYER"
    why_not_tbb = _load_tbb()
    numba.config.THREADING_LAYER = "tbb" if why_not_tbb is None else "workqueue"
    if why_not_tbb is None:
        return "tbb", "its waits spin briefly, then sleep, and no other library initializes it before us"
    return "workqueue", f"{why_not_tbb}; workqueue costs 1.3-2x more per small decode step than tbb"


_LAYER, _REASON = _pin_threading_layer()
_GOMP_BEFORE_US = _libgomp_loaded()  # an OpenMP runtime loaded before us ignores our wait policy


def resolve_num_threads(requested: int | None, cpu_ids: Collection[int]) -> int:
    """The kernel threads to run: requested, else one per core of cpu_ids; never more than numba's pool
    (NUMBA_NUM_THREADS, fixed when numba loads)."""
    return min(requested or len(cpu_ids), numba.config.NUMBA_NUM_THREADS)


def threading_decision() -> dict:
    """The threading layer in use and why, for the engine's decision log (call after numba's threads
    start)."""
    layer = numba.threading_layer()
    choice, reason, warn = layer, _REASON, layer != _LAYER or layer == "workqueue"
    if layer == "omp":
        policy = "inherited from an OpenMP runtime loaded before numaserve" if _GOMP_BEFORE_US else \
            os.environ.get("OMP_WAIT_POLICY", "unset")
        choice, warn = f"omp, OMP_WAIT_POLICY={policy}", warn or _GOMP_BEFORE_US
    elif layer == "tbb":
        choice = "tbb, adaptive waits"
    return {"choice": choice, "reason": reason if layer == _LAYER else f"asked for {_LAYER}; {reason}",
            "warn": warn}
