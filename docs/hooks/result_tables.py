"""Markdown from one JSON file of benchmarks/results: its caption and its tables.

Pure functions of the parsed JSON, no MkDocs (the tests import this module alone). `render_file` reads a
file, names where it came from (the command, the CPU, the date, the commit) and hands the data to the
renderer registered for its name (renderers_*.py). A file no renderer is registered for, or whose shape
its renderer does not expect, gets `generic()`, a short table of its scalar fields; a file that is not JSON
is listed with the parser's message. Nothing here raises on odd input.
"""

import json
import re
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = "benchmarks/results"
GENERIC_CPUS = {"", "x86_64", "AMD EPYC"}  # what some runs recorded: no model, so the README's word is better


@dataclass(frozen=True)
class Source:
    """What the JSON file itself may not record: the documented command, machine and commit of its run."""

    command: str
    machine: str | None = None
    commit: str | None = None
    note: str | None = None


def num(x, digits: int = 1) -> str:
    """A number for a table cell; anything else as text, None as an empty cell."""
    if x is None:
        return ""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return str(x)
    return f"{x:,.{digits}f}"


def times(x, digits: int = 2) -> str:
    return "" if not isinstance(x, (int, float)) else f"{x:.{digits}f}x"


def pct(x, digits: int = 1, sign: bool = False) -> str:
    if not isinstance(x, (int, float)):
        return ""
    return f"{100 * x:+.{digits}f}%" if sign else f"{100 * x:.{digits}f}%"


def gb(x) -> str:
    return "" if not isinstance(x, (int, float)) else f"{x / 1e9:.2f} GB"


def cell(x) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def labelled(label: str, body: str) -> str:
    return f"**{label}**\n\n{body}"


def meta_of(data) -> dict:
    """The run's description: `meta` where the file has one (`demo.meta` for the trained-heads file), else
    the top level."""
    if not isinstance(data, dict):
        return {}
    for m in (data.get("meta"), (data.get("demo") or {}).get("meta") if isinstance(data.get("demo"), dict)
              else None):
        if isinstance(m, dict):
            return m
    return data


def caption(name: str, data, source: Source | None) -> str:
    meta = meta_of(data)
    recorded = meta.get("command") or (data.get("command") if isinstance(data, dict) else None)
    recorded = recorded.strip() if isinstance(recorded, str) else None
    parts = [f"`{RESULTS_DIR}/{name}`"]
    if source:
        said = f"written by `{source.command}`"
        if recorded and recorded != source.command:
            said += f" (the file records `{recorded}`)"
        parts.append(said)
    elif recorded:
        parts.append(f"written by `{recorded}`")
    else:
        parts.append("command not recorded")
    machine = data.get("machine") if isinstance(data, dict) else None
    cpu = meta.get("cpu") or (machine.get("cpu") if isinstance(machine, dict) else None)
    cpu = cpu if isinstance(cpu, str) and cpu not in GENERIC_CPUS else None
    if cpu or (source and source.machine):
        parts.append(f"CPU: {cpu or source.machine}")
    else:
        parts.append("CPU not recorded")
    date = meta.get("date") or meta.get("time") or (data.get("date") if isinstance(data, dict) else None)
    if isinstance(date, str):
        parts.append(f"run {date.replace('T', ' ')}")
    commit = meta.get("revision") or meta.get("commit")
    revisions = data.get("revisions") if isinstance(data, dict) else None
    if isinstance(revisions, dict) and {"old", "new"} <= revisions.keys():
        commit = f"{revisions['new']} against {revisions['old']}"
    commit = commit or (source.commit if source else None)
    if commit:
        parts.append(f"commit {commit}")
    text = "From " + "; ".join(parts) + "."
    if source and source.note:
        text += " " + source.note
    return text


def generic(data) -> str:
    """A short table of a file's scalar fields (its top level and `meta`), and its first rows if it has a
    list of records under `rows`."""
    if not isinstance(data, dict):
        return f"A JSON {type(data).__name__}; no table for it."
    facts = [(k, v) for k, v in list(data.items()) + list(meta_of(data).items())
             if isinstance(v, (str, int, float, bool)) or v is None][:12]
    blocks = [table(["field", "value"], [[f"`{k}`", num(v, 4)] for k, v in facts])] if facts else []
    rows = data.get("rows")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        keys = [k for k, v in rows[0].items() if isinstance(v, (str, int, float, bool)) or v is None][:8]
        blocks.append(table(keys, [[num(r.get(k), 3) for k in keys] for r in rows[:30]]))
    if not blocks:
        blocks.append("Top-level fields: " + ", ".join(f"`{k}`" for k in list(data)[:20]) + ".")
    return "\n\n".join(blocks)


def render_data(name: str, data, renderers: list, sources: dict[str, Source]) -> tuple[str, bool]:
    """(caption and tables, whether a registered renderer drew them)."""
    head = caption(name, data, sources.get(name))
    for pattern, renderer in renderers:
        if re.fullmatch(pattern, name):
            try:
                return f"{head}\n\n{renderer(data)}", True
            except (LookupError, TypeError, ValueError, AttributeError, ArithmeticError):  # an odd shape
                break
    note = "The page's builder does not know this file's shape; its scalar fields:"
    return f"{head} {note}\n\n{generic(data)}", False


def render_file(path: Path, renderers: list, sources: dict[str, Source]) -> tuple[str, bool]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"`{RESULTS_DIR}/{path.name}` could not be read as JSON ({e}).", False
    return render_data(path.name, data, renderers, sources)
