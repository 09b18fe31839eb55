"""MkDocs hook: the performance page's tables and plots, built from benchmarks/results at every build, so
the page cannot drift from the results.

In a page, a line `<!-- results NAME.json -->` becomes that file's caption (command, CPU, date, commit),
its tables (result_tables.py and the renderers) and its plot, NAME.png beside it; `<!-- results NAME.json
collapsed -->` puts the same in a collapsed block; `<!-- results others -->` renders every results file
that no marker names. The PNGs are added to the site as results/NAME.png, so the page links files of the
site (strict mode refuses links outside docs/). A marker naming a missing file is a warning (strict mode
fails the build); a file of unknown shape gets a generic table; nothing here raises on a results file.
"""

import logging
import posixpath
import re
from pathlib import Path

import renderers_engine
import renderers_serving
import renderers_speculation
from result_sources import SOURCES
from result_tables import render_file

log = logging.getLogger("mkdocs.hooks.performance")
RENDERERS = renderers_engine.RENDERERS + renderers_serving.RENDERERS + renderers_speculation.RENDERERS
MARKER = re.compile(r"^<!-- results (\S+)( collapsed)? -->$", re.MULTILINE)
SITE_DIR = "results"  # the plots' folder in the site


def results_dir(config) -> Path:
    return Path(config.config_file_path).parent / "benchmarks" / "results"


def on_files(files, config):
    from mkdocs.structure.files import File

    for png in sorted(results_dir(config).glob("*.png")):
        files.append(File.generated(config, f"{SITE_DIR}/{png.name}", abs_src_path=str(png)))
    return files


def block(path: Path, page_dir: str, collapsed: bool) -> str:
    if not path.exists():
        log.warning(f"performance: {path.name} is named on the page but not in benchmarks/results")
        return f"`benchmarks/results/{path.name}` is not in the repository."
    body, known = render_file(path, RENDERERS, SOURCES)
    if not known:
        log.info(f"performance: {path.name}: no renderer for its shape; a generic table")
    png = path.with_suffix(".png")
    if png.exists():
        url = posixpath.relpath(f"{SITE_DIR}/{png.name}", page_dir or ".")
        body += f"\n\n![{png.name}]({url})"
    if not collapsed:
        return body
    indented = "\n".join("    " + line if line else "" for line in body.splitlines())
    return f'??? note "{path.name}"\n\n{indented}'


def expand(markdown: str, directory: Path, page_dir: str = "") -> str:
    """The page with its markers replaced (page_dir: the page's folder in docs/, for the plots' links)."""
    named = {m[1] for m in MARKER.finditer(markdown)}

    def others() -> str:
        rest = [p for p in sorted(directory.glob("*.json")) if p.name not in named]
        plots = [p for p in sorted(directory.glob("*.png"))
                 if p.with_suffix(".json").name not in named and not p.with_suffix(".json").exists()]
        if not rest and not plots:
            return "Every results file is shown above."
        parts = [block(p, page_dir, collapsed=True) for p in rest]
        parts += [f"![{p.name}]({posixpath.relpath(f'{SITE_DIR}/{p.name}', page_dir or '.')})" for p in plots]
        return "\n\n".join(parts)

    def replace(m: re.Match) -> str:
        if m[1] == "others":
            return others()
        return block(directory / m[1], page_dir, collapsed=bool(m[2]))

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown, page, config, files):
    if not MARKER.search(markdown):
        return markdown
    return expand(markdown, results_dir(config), posixpath.dirname(page.file.src_uri))
