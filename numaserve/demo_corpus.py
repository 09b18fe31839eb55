"""The demo family's corpus, one rule for everyone who reads it: training (scripts/train_demo.py), calibration
(`numaserve calibrate` without --text) and the benchmarks (benchmarks/heldout_*.py).

The standard library's .py files in sorted path order, without site-packages, files over MAX_FILE_BYTES,
non-UTF-8 files and generated ones; every HELDOUT_EVERY-th kept file is held out. A file is in the "tests"
subset when a folder on its path is a test folder or its name starts with test_, else in "library".
"""

import re
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MAX_FILE_BYTES = 200_000
HELDOUT_EVERY = 10
GENERATED = re.compile(r"auto-?generated|generated (by|from)|do not edit", re.IGNORECASE)
TEST_DIRS = {"test", "tests", "idle_test"}


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def kept_files() -> Iterator[tuple[Path, str]]:
    """(path, text) of every kept file, in order."""
    root = stdlib_root()
    for path in sorted(p for p in root.rglob("*.py") if "site-packages" not in p.relative_to(root).parts):
        text = read_source(path)
        if text is not None:
            yield path, text


def read_source(path: Path) -> str | None:
    """The file's text, or None where the corpus leaves it out."""
    raw = path.read_bytes()
    if len(raw) > MAX_FILE_BYTES:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if GENERATED.search(text[:1024]) else text


def is_heldout(kept_index: int) -> bool:
    return kept_index % HELDOUT_EVERY == 0


def subset(path: Path) -> str:
    """"tests" or "library"."""
    rel = path.relative_to(stdlib_root())
    return "tests" if TEST_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_") else "library"


def heldout_files() -> list[tuple[Path, str]]:
    """The held-out files' (path, text), in path order."""
    return [(p, t) for i, (p, t) in enumerate(kept_files()) if is_heldout(i)]


def heldout_texts() -> list[str]:
    """The held-out files' texts in the model card's order: the tests subset, then the library subset."""
    files = heldout_files()
    return [t for p, t in files if subset(p) == "tests"] + [t for p, t in files if subset(p) == "library"]
