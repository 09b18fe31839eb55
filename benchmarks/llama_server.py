"""llama.cpp's own tools (`llama-server`, `llama-imatrix`, `llama-quantize`, ...), built once from the
llama.cpp source that ships inside the llama-cpp-python sdist of the installed version (its
`vendor/llama.cpp`), so the tools and the llama-cpp-python the other benchmarks and tests use are the same
llama.cpp.

    python -m benchmarks.llama_server [TOOL ...]   # build (or find) them (default llama-server), print paths
                                                   # (TOOL lib-noamx: the libraries without AMX, below)

The sdist comes from pip's index (`pip download --no-binary`); the build is CMake's Release build of each
tool's target with `-DGGML_NATIVE=ON` (this CPU's instruction sets, as llama-cpp-python's own wheel
build), no tests or examples, no web UI download (offline), ~5 minutes on 2 cores. Everything is cached under
~/.cache/numaserve/llama-server/<version>/, outside the repo."""

import os
import shutil
import subprocess
import sys
import tarfile
from importlib.metadata import version
from pathlib import Path

CACHE = Path(os.environ.get("NUMASERVE_CACHE", Path.home() / ".cache" / "numaserve")) / "llama-server"
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_TESTS=OFF",
               "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF", "-DBUILD_SHARED_LIBS=OFF")


def llama_server_binary() -> Path:
    """The path of a built llama-server for the installed llama-cpp-python version (built on first use)."""
    return llama_cpp_tool("llama-server")


def llama_cpp_tool(name: str) -> Path:
    """The path of llama.cpp's tool `name` (a CMake target: llama-imatrix, llama-quantize, ...) for the
    installed llama-cpp-python version, built on first use."""
    release = version("llama_cpp_python")
    root = CACHE / release
    binary = root / name
    if binary.exists():
        return binary
    source = _vendored_source(root, release)
    build = root / "build"
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *CMAKE_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", name, "-j", jobs], check=True)
    shutil.copy2(build / "bin" / name, binary)
    return binary


# llama.cpp's shared libraries for llama-cpp-python (LLAMA_CPP_LIB_PATH) without its AMX path: on a CPU with
# AMX, llama-cpp-python's own build (-march=native) crashed in ggml_backend_amx_mul_mat (llama.cpp issue
# 20824) on this VM, so the benchmarks run this build there: every other instruction set the CPU has that
# ggml uses (AVX-512 with VNNI, VBMI and BF16; AVX-VNNI), its online repacking included
NO_AMX_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=ON", "-DGGML_AVX512=ON",
                "-DGGML_AVX512_VBMI=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
                "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF",
                "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                "-DLLAMA_BUILD_SERVER=OFF", "-DBUILD_SHARED_LIBS=ON", "-DLLAMA_OPENSSL=OFF")


def host_has_amx() -> bool:
    """Whether this CPU reports AMX (Linux /proc/cpuinfo)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def llama_cpp_library_without_amx() -> Path:
    """The directory of libllama.so and its ggml libraries built without AMX from the installed
    llama-cpp-python's llama.cpp (built on first use, ~5 minutes on 2 cores), for LLAMA_CPP_LIB_PATH."""
    release = version("llama_cpp_python")
    root = CACHE / release
    lib = root / "lib-noamx"
    if (lib / "libllama.so").exists():
        return lib
    source = _vendored_source(root, release)
    build = root / "build-noamx"
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "-S", str(source), "-B", str(build), "-G", "Ninja", *NO_AMX_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama", "-j", jobs], check=True)
    lib.mkdir(exist_ok=True)
    for so in (build / "bin").glob("lib*.so*"):
        shutil.copy2(so, lib / so.name, follow_symlinks=True)
    return lib


def _vendored_source(root: Path, release: str) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist `release`, unpacked under root."""
    source = root / f"llama_cpp_python-{release}" / "vendor" / "llama.cpp"
    if source.exists():
        return source
    root.mkdir(parents=True, exist_ok=True)
    sdists = list(root.glob(f"llama_cpp_python-{release}.tar.gz"))
    if not sdists:
        # the sdist alone from source: its build requirements (which pip installs to read its metadata) as
        # wheels (":all:" built those from source too, for many minutes)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", "llama-cpp-python",
                        "--no-deps", "-d", str(root), f"llama-cpp-python=={release}"], check=True)
        sdists = list(root.glob(f"llama_cpp_python-{release}.tar.gz"))
    prefix = f"llama_cpp_python-{release}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(root, members=members, filter="data")
    return source


if __name__ == "__main__":
    for tool in sys.argv[1:] or ["llama-server"]:
        print(llama_cpp_library_without_amx() if tool == "lib-noamx" else llama_cpp_tool(tool))
