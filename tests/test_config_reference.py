"""The settings reference (docs/reference/settings.md) is generated from the settings dataclasses and must
match them: `edgeserve config reference` is the only way it changes."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from edgeserve.cli import main
from edgeserve.config import Settings, _env_overrides
from edgeserve.config_allowlist import ALLOWED
from edgeserve.settings_reference import field_comments, render
from edgeserve.settings_tools import is_live

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "reference" / "settings.md"
ROW = re.compile(r"^\| `(\w+)` \| [^|]+ \| [^|]+ \| `(EDGESERVE_\w+)` \| (live|restart) \| (yes|no) \|", re.M)


def _rows() -> dict[str, tuple[str, str, str]]:
    """ "section.key" -> (environment variable, live|restart, fleet yes|no), from the committed page."""
    rows: dict[str, tuple[str, str, str]] = {}
    for block in PAGE.read_text().split("\n## `[")[1:]:
        section = block.split("]", 1)[0]
        for key, env, live, fleet in ROW.findall(block):
            rows[f"{section}.{key}"] = (env, live, fleet)
    return rows


def test_the_committed_reference_is_what_the_code_generates() -> None:
    assert PAGE.read_text() == render(), (
        "docs/reference/settings.md is stale: run "
        "`edgeserve config reference --out docs/reference/settings.md`"
    )


def test_every_setting_has_a_row_whose_environment_variable_sets_it() -> None:
    rows = _rows()
    settings = {
        f"{section}.{key}" for section, values in Settings().__dict__.items() for key in values.__dict__
    }
    assert set(rows) == settings
    for name, (env, live, fleet) in rows.items():
        section, key = name.split(".", 1)
        assert _env_overrides({env: "x"}) == {section: {key: "x"}}, name  # the loader reads that variable
        assert (live == "live") == is_live(name), name
        assert (fleet == "yes") == (name in ALLOWED), name


def test_the_cli_writes_the_reference(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sub" / "settings.md"
    assert main(["config", "reference", "--out", str(out)]) == 0
    assert out.read_text() == render()
    assert main(["config", "reference"]) == 0
    assert capsys.readouterr().out == render()


def test_comments_above_and_beside_a_field_describe_it(tmp_path: Path) -> None:
    source = tmp_path / "sections_sample.py"
    source.write_text(
        "from dataclasses import dataclass\n\n\n@dataclass\nclass Sample:\n"
        '    """A section."""\n\n'
        "    plain: int = 1\n"
        "    beside: int = 2  # says why\n"
        "    # First line of a block\n    # that goes on.\n"
        "    above: str = 'x'  # and beside. fmt: skip is not a directive here\n"
        "    # a header for the next fields.\n"
        "    tuned: float = 1.0  # the field itself\n"
        "    skipped: int = 3  # fmt: skip\n"
    )
    spec = importlib.util.spec_from_file_location("sections_sample", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sections_sample"] = module
    try:
        spec.loader.exec_module(module)
        comments = field_comments(module.Sample)
    finally:
        del sys.modules["sections_sample"]
    assert comments == {
        "plain": "",
        "beside": "says why",
        "above": "First line of a block that goes on. And beside. fmt: skip is not a directive here",
        "tuned": "a header for the next fields. The field itself",
        "skipped": "",
    }
