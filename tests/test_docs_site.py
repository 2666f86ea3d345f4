"""The documentation builds as a site with `mkdocs build --strict`: a broken link, a missing anchor or a
page left out of the navigation fails CI. The README stays a five-minute read."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ROOT / "scripts" / "mkdocs_hooks.py"


def _mkdocs(project: Path, site: Path) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("mkdocs", reason="mkdocs is not installed: pip install -e '.[docs]'")
    pytest.importorskip("material", reason="mkdocs-material is not installed: pip install -e '.[docs]'")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=project,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    result = _mkdocs(ROOT, tmp_path / "site")
    assert result.returncode == 0, result.stderr[-6000:]
    for page in (
        "index.html",
        "reference/settings/index.html",
        "security/index.html",
        "benchmarks/index.html",
    ):
        assert (tmp_path / "site" / page).is_file(), page
    home = (tmp_path / "site" / "index.html").read_text()
    assert 'href="api/"' in home and 'src="images/watch-overlay.png"' in home  # README links, rewritten


def test_a_broken_link_or_a_link_off_the_site_fails_the_build(tmp_path: Path) -> None:
    """The hook and the strict settings are what make the check real: try both kinds of bad link."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "mkdocs.yml").write_text(
        f"site_name: t\ntheme: material\nstrict: true\nhooks: ['{HOOKS}']\n"
        "validation: {anchors: warn, omitted_files: warn, unrecognized_links: warn}\n"
        "nav: [index.md, a.md]\n"
    )
    (tmp_path / "README.md").write_text("# Home\n\n[page a](docs/a.md#part)\n")
    (tmp_path / "tool.py").write_text("print()\n")
    (tmp_path / "docs" / "a.md").write_text("# A\n\n## Part\n\n[home](../README.md)\n")
    good = _mkdocs(tmp_path, tmp_path / "site")
    assert good.returncode == 0, good.stderr
    assert 'href="a/#part"' in (tmp_path / "site" / "index.html").read_text()

    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n[missing](missing.md) [tool](../tool.py) [no](#nowhere)\n"
    )
    bad = _mkdocs(tmp_path, tmp_path / "site2")
    assert bad.returncode != 0
    assert "'missing.md'" in bad.stderr and "tool.py" in bad.stderr and "#nowhere" in bad.stderr


def test_the_readme_is_short_and_points_only_into_the_repository() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) < 250
    assert len((ROOT / "benchmarks" / "README.md").read_text().splitlines()) < 300
    assert "bash scripts/run.sh" in readme and "bash scripts/test.sh" in readme
    for target in re.findall(r"\]\(([^)#\s]+)", readme):
        assert not target.startswith(("../", "/")), target
        assert target.startswith("http") or (ROOT / target).exists(), target


def test_every_test_the_threat_model_names_exists() -> None:
    """docs/security.md backs each statement with a test: every `file.py::name` it names is defined
    (bare file names are in tests/security/; `::name` continues the file named last)."""
    text = (ROOT / "docs" / "security.md").read_text()
    current: Path | None = None
    missing: list[str] = []
    names = 0
    for match in re.finditer(r"((?:tests/(?:[\w/]+/)?)?test_\w+\.py)|::(test_\w+)", text):
        if match[1]:
            path = match[1] if match[1].startswith("tests/") else f"tests/security/{match[1]}"
            current = ROOT / path
            if not current.is_file():
                missing.append(path)
        elif current is not None:
            names += 1
            if not re.search(rf"^(?:async )?def {match[2]}\b", current.read_text(), re.M):
                missing.append(f"{current.relative_to(ROOT)}::{match[2]}")
    assert names > 50 and not missing, missing
