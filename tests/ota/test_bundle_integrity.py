"""An installed bundle against its signed manifest (repository/bundle_files.py), and the modes the store
gives what it creates whatever the umask (fsutil): real bundles built and signed by `bundle build`,
unpacked by the installer's own extraction into a real store."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from ota_fixtures import Fleet, make_fleet

from edgeserve.fsutil import private_mkdir, tighten, write_bytes_atomic
from edgeserve.ota import archive
from edgeserve.ota.errors import StoreError
from edgeserve.ota.installer import Installer
from edgeserve.ota.manifest import parse_manifest
from edgeserve.ota.store import Store, Version
from edgeserve.repository import bundle_files
from edgeserve.supervisor.activate import OfflineActivator, TrialRunner


@contextlib.contextmanager
def umask(mask: int) -> Iterator[None]:
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


def unpack(fleet: Fleet, version: int) -> Version:
    """What the installer does up to the rename into bundles/: extract, manifest beside, promote."""
    bundle = fleet.bundle(version)
    body, signature = archive.read_header(bundle)
    manifest = parse_manifest(body)
    store = Store(fleet.state)
    store.ensure()
    staging = store.new_staging(f"test{version}") / "unpack"
    archive.extract(bundle, manifest, staging)
    (staging / "manifest.json").write_bytes(body)
    (staging / "manifest.sig").write_bytes(signature)
    return store.promote(staging, manifest.name, manifest.version)


def modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in [root, *root.rglob("*")]}


def test_an_untouched_bundle_matches_and_each_change_is_named(fleet: Fleet) -> None:
    version = unpack(fleet, 1)
    model_dir = version.path / "models" / "mlp"
    assert bundle_files.problems(version.path) == []
    bundle_files.check_model_folder(fleet.state, model_dir)  # not the active one: checked all the same

    onnx = model_dir / "1" / "model.onnx"
    signed = onnx.read_bytes()
    (model_dir / "1" / "extra.py").write_text("print('x')\n")
    (version.path / "models" / "other").mkdir()
    (version.path / "notes.txt").write_text("x")
    onnx.unlink()
    found = bundle_files.problems(version.path)
    assert found == [
        "notes.txt: a file the signed manifest does not list",
        "models/other/: a folder the signed manifest does not list",
        "models/mlp/1/extra.py: a file the signed manifest does not list",
        "models/mlp/1/model.onnx: missing",
    ], found
    first = r"^bundle vision-v1: models/mlp/1/extra\.py: a file"
    with pytest.raises(bundle_files.BundleDamaged, match=first):
        bundle_files.check_model_folder(fleet.state, model_dir)
    onnx.write_bytes(signed)
    (model_dir / "1" / "extra.py").unlink()
    (version.path / "models" / "other").rmdir()
    (version.path / "notes.txt").unlink()
    assert bundle_files.problems(version.path) == []


def test_a_same_size_rewrite_with_the_old_mtime_is_caught_after_a_clean_check(fleet: Fleet) -> None:
    """The cache keys on the ctime too: no one can set it back, so a cached verdict never hides a change."""
    version = unpack(fleet, 1)
    onnx = version.path / "models" / "mlp" / "1" / "model.onnx"
    assert bundle_files.problems(version.path, "mlp") == []  # hashed, and cached
    before = onnx.stat()
    data = bytearray(onnx.read_bytes())
    data[-1] ^= 0xFF
    with open(onnx, "r+b") as fh:
        fh.write(data)
    os.utime(onnx, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = onnx.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino, before.st_size, before.st_mtime_ns
    )  # fmt: skip
    (found,) = bundle_files.problems(version.path, "mlp")
    assert found.startswith("models/mlp/1/model.onnx: changed (sha256 "), found


def test_a_manifest_that_is_a_link_or_not_json_fails_closed(fleet: Fleet) -> None:
    version = unpack(fleet, 1)
    manifest = version.path / "manifest.json"
    body = manifest.read_bytes()
    manifest.unlink()
    manifest.symlink_to(fleet.tmp / "elsewhere.json")
    with pytest.raises(bundle_files.BundleDamaged, match=r"manifest\.json: .*a link, or missing"):
        bundle_files.problems(version.path)
    manifest.unlink()
    manifest.write_bytes(b"{not json")
    with pytest.raises(bundle_files.BundleDamaged, match="not the manifest the installer verified"):
        bundle_files.problems(version.path)
    manifest.write_bytes(body)
    assert bundle_files.problems(version.path) == []


def test_a_rollback_to_a_changed_kept_version_is_refused(fleet: Fleet) -> None:
    store = Store(fleet.state)
    old, new = unpack(fleet, 1), unpack(fleet, 2)
    store.point(store.current_link, new)
    store.point(store.previous_link, old)
    (old.path / "models" / "mlp" / "1" / "helper.py").write_text("import os\n")
    installer = Installer(store, OfflineActivator(TrialRunner(fleet.state, None)))
    refusal = r"vision v1 does not match its signed manifest: models/mlp/1/helper\.py"
    with pytest.raises(StoreError, match=refusal):
        installer.rollback(1, lambda *a: None)
    assert store.active() == new and store.previous() == old  # nothing switched


def test_what_the_store_creates_is_the_owners_only_whatever_the_umask(fleet: Fleet) -> None:
    with umask(0):  # the loosest umask there is
        version = unpack(fleet, 1)
    store = Store(fleet.state)
    for folder in (store.root, store.bundles, store.staging, store.downloads):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    found = modes(version.path)
    assert set(found.values()) == {"0o755", "0o644"}, found
    assert all(v == "0o755" for k, v in found.items() if (version.path / k).is_dir()), found


def test_private_folders_and_atomic_files_whatever_the_umask(tmp_path: Path) -> None:
    with umask(0):
        private_mkdir(tmp_path / "a" / "b")
        write_bytes_atomic(tmp_path / "a" / "b" / "f", b"x")
    assert modes(tmp_path / "a") == {".": "0o700", "b": "0o700", "b/f": "0o600"}


def test_tighten_takes_group_and_other_write_from_what_the_service_keeps(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for folder in ("ota/bundles/vision-v1", "cache", "fleet", "elsewhere"):
        (state / folder).mkdir(parents=True)
    for path in (state / "ota/bundles/vision-v1/f", state / "fleet/settings.toml", state / "elsewhere/x"):
        path.write_text("x")
    for path in [state, *state.rglob("*")]:
        path.chmod(0o777 if path.is_dir() else 0o666)
    (state / "ota" / "current").symlink_to("bundles/vision-v1")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(state / "ota" / "s.sock"))
        os.chmod(state / "ota" / "s.sock", 0o777)
        changed = tighten(state)
        assert stat.S_IMODE(os.lstat(state / "ota" / "s.sock").st_mode) == 0o777  # sockets: their owners'
    bundle = ["ota", "ota/bundles", "ota/bundles/vision-v1", "ota/bundles/vision-v1/f"]
    assert sorted(changed) == sorted([".", *bundle, "cache", "fleet", "fleet/settings.toml"])
    assert modes(state / "ota" / "bundles") == {".": "0o755", "vision-v1": "0o755", "vision-v1/f": "0o644"}
    assert stat.S_IMODE((state / "elsewhere").stat().st_mode) == 0o777  # not the service's: left alone
    assert tighten(state) == []


def test_bytecode_an_earlier_release_wrote_into_a_bundle_is_removed_at_start(fleet: Fleet) -> None:
    """Its Python workers wrote `__pycache__` beside a model's code; the check would now fail the model."""
    version = unpack(fleet, 1)
    version_dir = version.path / "models" / "mlp" / "1"
    (version_dir / "__pycache__").mkdir()
    (version_dir / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\x00" * 16)
    (version.path / "models" / "mlp" / "__pycache__").symlink_to(fleet.tmp)  # a link is not bytecode
    assert len(bundle_files.problems(version.path)) == 3
    assert Store(fleet.state).drop_bytecode() == ["vision-v1/models/mlp/1/__pycache__"]
    assert bundle_files.problems(version.path) == [
        "models/mlp/__pycache__: a link, where the signed manifest lists nothing"
    ]
    assert fleet.tmp.is_dir()  # not followed
