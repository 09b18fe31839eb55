"""llama.cpp's own tools (`llama-server`, `llama-imatrix`, `llama-quantize`, ...), built once from the
llama.cpp source that ships inside the llama-cpp-python sdist of the installed version (its
`vendor/llama.cpp`), so the tools and the llama-cpp-python the other benchmarks and tests use are the same
llama.cpp.

    python -m benchmarks.llama_server [TOOL ...]   # build (or find) them (default llama-server), print paths

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


def _vendored_source(root: Path, release: str) -> Path:
    """vendor/llama.cpp of the llama-cpp-python sdist `release`, unpacked under root."""
    source = root / f"llama_cpp_python-{release}" / "vendor" / "llama.cpp"
    if source.exists():
        return source
    root.mkdir(parents=True, exist_ok=True)
    sdists = list(root.glob(f"llama_cpp_python-{release}.tar.gz"))
    if not sdists:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:", "--no-deps",
                        "-d", str(root), f"llama-cpp-python=={release}"], check=True)
        sdists = list(root.glob(f"llama_cpp_python-{release}.tar.gz"))
    prefix = f"llama_cpp_python-{release}/vendor/llama.cpp/"
    with tarfile.open(sdists[0]) as archive:
        members = [m for m in archive.getmembers() if m.name.startswith(prefix)]
        archive.extractall(root, members=members, filter="data")
    return source


if __name__ == "__main__":
    for tool in sys.argv[1:] or ["llama-server"]:
        print(llama_cpp_tool(tool))
