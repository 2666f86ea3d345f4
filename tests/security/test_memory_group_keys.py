"""Which Python models may share a worker (edgeserve/backends/python/group.py): the group name and the
origin of the code (the folder holding the model folders: the repository, or one installed bundle's
models folder, by identity) must both match, so a bundle's code never shares a process with local code
or with another bundle's under the same group name; a bad group name is refused with the field and the
fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgeserve.backends.python.group import check_group_name, group_key


def _model(origin: Path, name: str) -> Path:
    path = origin / name / "1" / "model.py"
    path.parent.mkdir(parents=True)
    path.write_text("")
    return path


def test_the_same_group_from_two_origins_is_two_groups(tmp_path: Path) -> None:
    local_a, local_b = _model(tmp_path / "repo", "a"), _model(tmp_path / "repo", "b")
    bundled = _model(tmp_path / "bundles" / "b1" / "models", "a")
    assert group_key("ocr", local_a) == group_key("ocr", local_b)
    assert group_key("ocr", local_a) != group_key("ocr", bundled)
    assert group_key("ocr", local_a) != group_key("other", local_b)


def test_a_folder_made_again_is_another_origin(tmp_path: Path) -> None:
    before = group_key("ocr", _model(tmp_path / "bundle" / "models", "a"))
    (tmp_path / "bundle").rename(tmp_path / "old")  # what an update does: a new folder in its place
    after = group_key("ocr", _model(tmp_path / "bundle" / "models", "a"))
    assert before.origin == after.origin and before != after


@pytest.mark.parametrize("name", ["", "../x", "a b", "x" * 65, "ocr;rm"])
def test_a_bad_group_name_names_the_field_and_the_fix(name: str) -> None:
    with pytest.raises(
        ValueError, match=r"model 'm' config: parameters\['python_worker_group'\] = .*: use 1-64"
    ):
        check_group_name(name, "model 'm' config")
    assert check_group_name("ocr.v2_a-1", "x") == "ocr.v2_a-1"
