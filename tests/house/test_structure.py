"""The house rules, read off the source: the walls between packages (DESIGN's table), no import circle, no
import running back up, the HTTP app without Ray, and the size of a product file and function."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("numaserve", "actors", "http_api", "scheduling", "models", "memory", "kernels", "cluster_configs")
# package -> the packages it may import (besides itself); benchmarks/, scripts/ and tests/ may import anything
MAY_IMPORT = {
    "numaserve": {"actors", "http_api", "scheduling", "models", "memory", "kernels", "cluster_configs"},
    "actors": {"http_api", "scheduling", "models", "memory", "kernels", "cluster_configs"},
    "http_api": {"scheduling", "models", "memory", "kernels", "cluster_configs"},
    "scheduling": {"models", "memory", "kernels", "cluster_configs"},
    "models": {"memory", "kernels", "cluster_configs"},
    "memory": {"kernels", "cluster_configs"},
    "kernels": set(),
    "cluster_configs": set(),
}
RAY_PACKAGES = {"numaserve", "actors"}  # only these import ray
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60
KERNEL_DECORATORS = ("njit", "jit", "intrinsic", "overload", "register_jitable")


def modules() -> dict[str, Path]:
    found = {}
    for package in PRODUCT:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


MODULES = modules()


def imported(path: Path) -> set[str]:
    """Every module name an import statement in the file names, at any depth (type-checking ones too)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.update(f"{node.module}.{a.name}" for a in node.names)
            names.add(node.module)
    return names


def product_module(name: str) -> str | None:
    """The product module an imported name lives in (a from-import's name may be a class: its module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for module, path in MODULES.items():
        targets = {product_module(n) for n in imported(path)} - {None, module}
        # a package's __init__ is imported with any of its modules: not an edge of its own
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_each_package_imports_only_the_packages_below_it():
    wrong = [f"{m} -> {t}" for m, targets in import_graph().items() for t in targets
             if t.split(".")[0] != m.split(".")[0] and t.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    upward = [f"{m} -> {n}" for m, path in MODULES.items() for n in imported(path)
              if n.split(".")[0] in ("benchmarks", "tests", "scripts")]
    assert wrong + upward == []


def test_only_the_ray_shells_import_ray():
    offenders = [m for m, path in MODULES.items() if m.split(".")[0] not in RAY_PACKAGES
                 and any(n == "ray" or n.startswith("ray.") for n in imported(path))]
    assert offenders == []


def test_importing_the_http_app_leaves_ray_out():
    code = ("import sys; import http_api.app, http_api.serving; "
            "print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_no_product_file_is_over_400_lines():
    long = {m: n for m, path in MODULES.items() if (n := path.read_text().count("\n")) > MAX_FILE_LINES}
    assert long == {}


@pytest.mark.parametrize("package", PRODUCT)
def test_no_function_is_over_60_lines_outside_numba_kernels(package):
    long = []
    for module, path in MODULES.items():
        if module.split(".")[0] != package:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            decorators = [ast.unparse(d) for d in node.decorator_list]
            if any(k in d for d in decorators for k in KERNEL_DECORATORS):
                continue
            if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert long == []
