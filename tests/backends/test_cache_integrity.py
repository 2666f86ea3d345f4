"""Sealed cache files (backends/cache.py) on real files: what passes, what is discarded and why."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from edgeserve.backends import cache
from edgeserve.fsutil import write_bytes_atomic

WHAT = "the test blob"
OTHER_UID = 65534  # nobody: a member of the service group, not edgeserve's user


def _sealed(tmp_path: Path, data: bytes = b"compiled bytes" * 100) -> Path:
    path = tmp_path / "cache" / "model.blob"
    cache.write_sealed(path, data)
    return path


def _gone(path: Path) -> bool:
    return not path.exists() and not cache.seal_path(path).exists()


def test_written_then_read_back(tmp_path: Path) -> None:
    path = _sealed(tmp_path)
    assert cache.read_sealed(path, WHAT) == b"compiled bytes" * 100
    assert path.stat().st_mode & 0o777 == 0o600 and cache.seal_path(path).stat().st_mode & 0o777 == 0o600
    seal = json.loads(cache.seal_path(path).read_text())
    assert seal["name"] == "model.blob" and seal["size"] == 1400
    assert cache.read_sealed(tmp_path / "cache" / "absent.blob", WHAT) is None


def test_changed_bytes_are_discarded_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _sealed(tmp_path)
    with open(path, "r+b") as fh:  # same size, other bytes: a bad sector, or a write of ours gone wrong
        fh.write(b"X")
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        assert cache.read_sealed(path, WHAT) is None
    assert f"discarding {WHAT} {path}: its content" in caplog.text and "rebuilt, not loaded" in caplog.text
    assert _gone(path)


def test_a_replaced_file_is_discarded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = _sealed(tmp_path)
    planted = path.with_name("planted")
    planted.write_bytes(b"attacker bytes")
    os.replace(planted, path)  # a new file under the old name, with the old seal beside it
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        assert cache.read_sealed(path, WHAT) is None
    assert "bytes, its seal says" in caplog.text and _gone(path)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to make a file of another user")
def test_a_file_of_another_user_is_discarded_even_with_a_matching_seal(tmp_path: Path) -> None:
    """Someone else's file is never trusted: they could rewrite it after the check."""
    path = _sealed(tmp_path)
    os.chown(path, OTHER_UID, -1)
    assert cache.read_sealed(path, WHAT) is None and _gone(path)
    path = _sealed(tmp_path)
    os.chown(cache.seal_path(path), OTHER_UID, -1)  # a forged seal (theirs) beside our file
    assert cache.read_sealed(path, WHAT) is None and _gone(path)


def test_a_group_writable_file_or_seal_is_discarded(tmp_path: Path) -> None:
    path = _sealed(tmp_path)
    path.chmod(0o660)
    assert cache.read_sealed(path, WHAT) is None and _gone(path)
    path = _sealed(tmp_path)
    cache.seal_path(path).chmod(0o664)
    assert cache.read_sealed(path, WHAT) is None and _gone(path)


def test_no_seal_a_foreign_seal_or_a_symlink_is_discarded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _sealed(tmp_path)
    cache.seal_path(path).unlink()
    with caplog.at_level(logging.WARNING, "edgeserve.cache"):
        assert cache.read_sealed(path, WHAT) is None
    assert "has no seal" in caplog.text and _gone(path)

    # our own seal and file of another entry, renamed into this one's place
    other = tmp_path / "cache" / "other.blob"
    cache.write_sealed(other, b"another model")
    os.replace(other, path)
    os.replace(cache.seal_path(other), cache.seal_path(path))
    assert cache.read_sealed(path, WHAT) is None and _gone(path)

    secret = tmp_path / "secret"
    secret.write_bytes(b"not a cache file")
    path.symlink_to(secret)
    assert cache.read_sealed(path, WHAT) is None
    # the link went, not its target
    assert not path.is_symlink() and secret.read_bytes() == b"not a cache file"


def test_unchanged_inode_and_mtime_skip_the_hash_and_a_touch_is_resealed(tmp_path: Path) -> None:
    path = _sealed(tmp_path)
    seal_file = cache.seal_path(path)
    seal = json.loads(seal_file.read_text())
    # Prove the fast path: a seal whose digest is wrong still passes while (inode, mtime, size) hold ...
    write_bytes_atomic(seal_file, json.dumps({**seal, "sha256": "0" * 64}).encode())
    seal_file.chmod(0o600)
    assert cache.read_sealed(path, WHAT) is not None
    # ... and a new mtime makes it hash: the doctored digest no longer matches
    os.utime(path, ns=(seal["mtime_ns"] + 10**9, seal["mtime_ns"] + 10**9))
    assert cache.read_sealed(path, WHAT) is None and _gone(path)

    path = _sealed(tmp_path)  # the same bytes with a new mtime (a restore): kept, and sealed anew
    os.utime(path, ns=(10**18, 10**18))
    assert cache.read_sealed(path, WHAT) is not None
    assert json.loads(cache.seal_path(path).read_text())["mtime_ns"] == 10**18


def test_a_runtime_folder_is_checked_before_and_sealed_after(tmp_path: Path) -> None:
    folder = tmp_path / "onnxruntime"
    with cache.runtime_folder(folder, "a runtime's engine"):
        folder.mkdir()
        (folder / "engine.trt").write_bytes(b"what the runtime wrote")
        os.chmod(folder / "engine.trt", 0o600)
    assert cache.read_seal(folder / "engine.trt")["size"] == len(b"what the runtime wrote")
    (folder / "planted.trt").write_bytes(b"attacker bytes")  # no seal: the runtime would trust it
    (folder / "sub").mkdir()
    (folder / "sub" / "nested.trt").write_bytes(b"attacker bytes")
    discarded = cache.check_folder(folder, "a runtime's engine")
    assert sorted(p.name for p in discarded) == ["nested.trt", "planted.trt"]
    assert sorted(p.name for p in folder.rglob("*") if p.is_file()) == ["engine.trt", "engine.trt.seal"]
    with cache.runtime_folder(None, "no cache"):  # no folder: nothing to do
        pass
