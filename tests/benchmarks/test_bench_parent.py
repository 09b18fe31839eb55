"""`numaserve bench`'s parent process imports no engine module: bench_decode.main restarts itself while it
finds one imported (under `numaserve bench`), so one imported by bench_decode itself would restart it
forever."""

import subprocess
import sys


def test_importing_bench_decode_and_its_probes_imports_no_engine_module():
    code = ("import sys, benchmarks.bench_decode as b, benchmarks.machine, benchmarks.peak_kernels; "
            "print(','.join(m for m in b.ENGINE_MODULES if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"imported by the bench's parent: {out.stdout.strip()}"
