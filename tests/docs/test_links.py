"""Every link in README.md and docs/ resolves to a file inside the repository, and the README stays a door.

Markdown links and images (inline, reference definitions, and HTML href/src) outside code are checked
without building the site: a relative target must exist, resolved from the file that holds it (a docs page's
`usage/index.md#sessions` from the page's folder; the anchor is MkDocs' strict build's to check). A link to a
URL (http:, https:, mailto:, file:, ...), an absolute path, or a path that leaves the repository fails: the
docs must read the same from a clone with no network.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 200
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)"
                    r"(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)", re.MULTILINE)
AUTOLINK = re.compile(r"<([A-Za-z][A-Za-z0-9+.-]*:[^\s<>]*)>")
HTML = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']*)["']""", re.IGNORECASE)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def prose(text: str) -> str:
    """The text without fenced code blocks and code spans (what they hold is not a link)."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    body = prose(text)
    found = [m[1] for m in INLINE.finditer(body)] + [m[1] for m in REFERENCE.finditer(body)]
    found = [t[1:-1] if t.startswith("<") and t.endswith(">") else t for t in found]
    return found + [m[1] for m in AUTOLINK.finditer(body)] + [m[1] for m in HTML.finditer(body)]


def problem(page: Path, target: str) -> str | None:
    """Why target, a link in page, does not resolve inside the repository; None if it does."""
    if not target:
        return "an empty link"
    if SCHEME.match(target):
        return "a URL: link files inside the repository, name outside projects in plain text"
    if target.startswith(("/", "\\")):
        return "an absolute path: link relative to the page"
    path = target.split("#", 1)[0].split("?", 1)[0]
    if not path:
        return None  # an anchor on the same page
    resolved = (page.parent / path).resolve()
    if not resolved.is_relative_to(ROOT):
        return "a path outside the repository"
    if not resolved.exists():
        return "no such file"
    return None


def test_the_pages_are_found():
    assert ROOT / "docs" / "index.md" in PAGES and len(PAGES) > 5


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_link_resolves_inside_the_repository(page):
    bad = [f"{target}: {why}" for target in links(page.read_text(encoding="utf-8"))
           if (why := problem(page, target))]
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_readme_links_into_the_docs():
    targets = links((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(t.startswith("docs/") for t in targets), targets


def test_the_readme_is_at_most_200_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move the rest into docs/"


@pytest.mark.parametrize("text, why", [
    ("[a](https://example.com)", "a URL"),
    ("[a](http://example.com/x.md)", "a URL"),
    ("<https://example.com>", "a URL"),
    ("[a](mailto:x@example.com)", "a URL"),
    ("![plot](file:///tmp/x.png)", "a URL"),
    ('<img src="https://example.com/x.png">', "a URL"),
    ("[a](/docs/index.md)", "an absolute path"),
    ("[a](../../shared/DESIGN.md)", "a path outside the repository"),
    ("[a](no-such-page.md#top)", "no such file"),
    ("[a]: https://example.com", "a URL"),
])
def test_bad_links_are_caught(text, why):
    page = ROOT / "docs" / "index.md"
    found = links(text)
    assert found and all((problem(page, t) or "").startswith(why) for t in found), found


@pytest.mark.parametrize("text", [
    "[a](usage/index.md#sessions)",
    "[a](#a-heading)",
    "![plot](../benchmarks/results/decode.png 'the plot')",
    "`[a](https://example.com)` in code",
    "```\n[a](https://example.com)\n```",
])
def test_good_links_and_code_pass(text):
    page = ROOT / "docs" / "index.md"
    assert not [t for t in links(text) if problem(page, t)]
