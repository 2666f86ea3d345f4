"""MkDocs hooks (mkdocs.yml `hooks:`): pages that live outside docs/, and links that work both on GitHub
and on the site.

The site is docs/ plus a few repository files that must stay where they are (REPO_PAGES: the README is
the home page; benchmarks/README.md and its history sit next to the scripts they document). Every page
links with paths relative to its own place in the repository, as GitHub resolves them; this hook
rewrites each such link to where its target lands on the site. A link to a repository file that is not
on the site (a script, a config) is an error: name such files as `code`, the site cannot serve them.
MkDocs itself then checks every link and anchor (`mkdocs build --strict`, tests/test_docs_site.py).
"""

from __future__ import annotations

import fnmatch
import logging
import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

log = logging.getLogger("mkdocs.hooks.edgeserve")

# Repository files (globs, relative to the repository root) published as pages, and where they land.
REPO_PAGES = {
    "README.md": "index.md",
    "benchmarks/README.md": "benchmarks/README.md",
    "benchmarks/history/*.md": "benchmarks/history/",
    "devices/README.md": "devices/README.md",
}
LINK = re.compile(r"(\]\()([^)\s]+)((?:\s+\"[^\"]*\")?\))")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def _root(config: Any) -> Path:
    return Path(config.config_file_path).resolve().parent


def _site_uri_of(repo_path: str, config: Any) -> str | None:
    """Where a repository path lands on the site, or None when it is not published."""
    docs = Path(config.docs_dir).resolve().relative_to(_root(config)).as_posix()
    if repo_path.startswith(docs + "/"):
        return repo_path[len(docs) + 1 :]
    for pattern, uri in REPO_PAGES.items():
        if fnmatch.fnmatchcase(repo_path, pattern):
            return uri + posixpath.basename(repo_path) if uri.endswith("/") else uri
    return None


def _repo_path_of(file: File, config: Any) -> str:
    return Path(file.abs_src_path or "").resolve().relative_to(_root(config)).as_posix()


def on_files(files: Files, config: Any) -> Files:
    root = _root(config)
    for pattern in REPO_PAGES:
        for path in sorted(root.glob(pattern)):
            uri = _site_uri_of(path.relative_to(root).as_posix(), config)
            if uri is not None:
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    here = _repo_path_of(page.file, config)
    fence = False
    out: list[str] = []
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fence = not fence
        if not fence:
            line = LINK.sub(lambda m: m[1] + _rewrite(m[2], here, page, config, files) + m[3], line)
        out.append(line)
    return "\n".join(out)


def _rewrite(target: str, here: str, page: Page, config: Any, files: Files) -> str:
    if target.startswith("#") or EXTERNAL.match(target):
        return target
    path, hash_, anchor = target.partition("#")
    repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(here), path))
    uri = _site_uri_of(repo_path, config)
    if uri is not None and files.get_file_from_path(uri) is not None:
        relative = posixpath.relpath(uri, posixpath.dirname(page.file.src_uri) or ".")
        return relative + hash_ + anchor
    if (_root(config) / repo_path).exists():
        log.warning(
            "%s links to %s, a repository file that is not on the site: name it as `code` instead",
            here,
            repo_path,
        )
    return target  # MkDocs reports a target that does not exist
