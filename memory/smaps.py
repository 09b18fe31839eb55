"""This process's memory mappings as /proc/self/smaps lists them: each mapping's address range, what it maps
(a file's path, a bracketed name such as [heap], or "" for anonymous memory) and its counters in kB (Rss,
FilePmdMapped, AnonHugePages, ...)."""

import re
from dataclasses import dataclass
from pathlib import Path

_RANGE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) ", re.MULTILINE)  # a mapping's first line


@dataclass(frozen=True)
class Mapping:
    start: int
    end: int  # one past its last byte
    path: str
    kb: dict[str, int]


def mappings(smaps: str | None = None) -> list[Mapping]:
    """smaps' text parsed (None: this process's now; [] where it cannot be read)."""
    text = _text(smaps)
    found: list[Mapping] = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if not fields:
            continue
        if "-" in fields[0] and not fields[0].endswith(":"):  # start-end perms offset dev inode [path]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append(Mapping(start, end, fields[5] if len(fields) > 5 else "", {}))
        elif found and len(fields) > 1 and fields[1].isdigit():  # "Name: value kB" (not VmFlags' words)
            found[-1].kb[fields[0].rstrip(":")] = int(fields[1])
    return found


def mapping_at(address: int, smaps: str | None = None) -> Mapping | None:
    """The mapping holding address (None: none, or smaps unreadable), its block alone parsed (a process with
    numba's LLVM loaded has thousands of mappings: benchmarks/results/HISTORY.md, warm loads)."""
    text = _text(smaps)
    starts = list(_RANGE.finditer(text))
    for i, m in enumerate(starts):
        if int(m.group(1), 16) <= address < int(m.group(2), 16):
            end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
            return mappings(text[m.start():end])[0]
    return None


def _text(smaps: str | None) -> str:
    try:
        return Path("/proc/self/smaps").read_text() if smaps is None else smaps
    except OSError:
        return ""
