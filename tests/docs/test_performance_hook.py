"""The performance page's builder (docs/hooks) turns every results file into tables without MkDocs, and
never fails on a file it does not know: an unknown shape gets a generic table, a broken file is listed."""

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT / "docs" / "hooks"))  # the hook's modules import each other as MkDocs loads them

import performance
from result_tables import render_file

FILES = sorted(RESULTS.glob("*.json"))


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_results_file_renders(path):
    text, _ = render_file(path, performance.RENDERERS, performance.SOURCES)
    assert f"benchmarks/results/{path.name}" in text and "|---|" in text


def test_the_page_names_only_files_that_exist():
    page = (ROOT / "docs" / "performance.md").read_text(encoding="utf-8")
    named = {m[1] for m in performance.MARKER.finditer(page)} - {"others"}
    assert named and all((RESULTS / name).exists() for name in named), sorted(named)


def test_unknown_shapes_and_broken_files_do_not_stop_the_build(tmp_path):
    (tmp_path / "mystery.json").write_text(json.dumps({"meta": {"cpu": "Zen 9"}, "speed": 3.5}))
    (tmp_path / "decode-odd.json").write_text(json.dumps({"rows": "not a list"}))  # a known name, odd shape
    (tmp_path / "broken.json").write_text("{not json")
    (tmp_path / "decode-odd.png").write_bytes(b"")
    page = ("# P\n\n<!-- results decode-odd.json -->\n\n<!-- results others -->\n\n"
            "<!-- results gone.json -->\n")
    out = performance.expand(page, tmp_path)
    assert "<!-- results" not in out
    assert "does not know this file's shape" in out and "| `speed` | 3.5000 |" in out  # generic tables
    assert "broken.json` could not be read as JSON" in out
    assert "![decode-odd.png](results/decode-odd.png)" in out
    assert "`benchmarks/results/gone.json` is not in the repository." in out
    assert re.search(r'^\?\?\? note "mystery.json"\n\n    From ', out, re.MULTILINE)  # collapsed, indented


def test_plots_are_linked_relative_to_the_page(tmp_path):
    (tmp_path / "batching.json").write_text((RESULTS / "batching.json").read_text())
    (tmp_path / "batching.png").write_bytes(b"")
    out = performance.expand("<!-- results batching.json -->", tmp_path, page_dir="guide")
    assert "![batching.png](../results/batching.png)" in out
