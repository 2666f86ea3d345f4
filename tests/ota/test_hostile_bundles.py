"""Hostile bundles against the device-side check path (hostile_check.py): every one refused with its own
reason. Here the signature and the header, truncated downloads and a full disk, with the positive
controls; test_hostile_archives.py has the archive-level attacks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hostile import (
    Bundle,
    blockdev,
    chardev,
    directory,
    fifo,
    flip_bit,
    flip_manifest_bit,
    hardlink,
    regular,
    signed_header,
    symlink,
    tar_data_offset,
    truncate,
    write_bundle,
    zeros,
)
from hostile_check import ARCH, CONFIG, FILES, Env, good_members, snapshot

from edgeserve.ota import archive, build, policy
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import Manifest, dump_manifest
from edgeserve.ota.policy import Policy


# ------------------------------------------------------------------------------- positive controls
@pytest.mark.parametrize("compress", [True, False], ids=["gz", "tar"])
def test_bundle_from_build_bundle_passes_all_five_steps(env: Env, compress: bool) -> None:
    repo = env.root / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    weights = os.urandom(300_000)
    (repo / "m" / "1" / "model.onnx").write_bytes(weights)
    (repo / "m" / "config.pbtxt").write_bytes(CONFIG)
    out = env.root / "out" / "demo-7.esb"
    request = build.BuildRequest(
        repo, "demo", 7, env.signer.private_path, out, arch=[ARCH], compress=compress
    )
    build.build_bundle(request)
    result = env.check(out, installed={"demo": 6})
    assert isinstance(result, Manifest), f"refused: {result}"
    assert result.version == 7
    assert (env.staging / "models/m/1/model.onnx").read_bytes() == weights
    assert (env.staging / "models/m/config.pbtxt").read_bytes() == CONFIG
    staged = sorted(str(p.relative_to(env.staging)) for p in env.staging.rglob("*") if p.is_file())
    assert staged == ["models/m/1/model.onnx", "models/m/config.pbtxt"]


@pytest.mark.parametrize("compress", [True, False], ids=["gz", "tar"])
def test_hostile_baseline_bundle_is_accepted(env: Env, compress: bool) -> None:
    """The crafted bundles differ from an accepted one by their attack only."""
    path = Bundle(env.manifest(), good_members()).write(env.root / "ok.esb", env.signer, compress=compress)
    result = env.check(path)
    assert isinstance(result, Manifest), f"refused: {result}"
    for name, data in FILES:
        assert (env.staging / name).read_bytes() == data


@pytest.mark.parametrize("security_version", [None, 0, 7, 2**31 - 1])
def test_security_version_absent_or_in_range_is_read(env: Env, security_version: int | None) -> None:
    """A manifest signed before the field existed reads as 0 (the upgrade path)."""
    data = env.manifest()
    if security_version is not None:
        data["security_version"] = security_version
    path = Bundle(data, good_members()).write(env.root / "ok.esb", env.signer)
    result = env.check(path)
    assert isinstance(result, Manifest), f"refused: {result}"
    assert result.security_version == (security_version or 0)


def test_folders_the_file_list_implies_are_accepted(env: Env) -> None:
    """What `tar -czf` writes: a folder member before the files in it, `models/` included."""
    folders = [directory(name) for name in ("models/", "models/m/", "models/m/1/")]
    path = Bundle(env.manifest(), [*folders, *good_members()]).write(env.root / "ok.esb", env.signer)
    result = env.check(path)
    assert isinstance(result, Manifest), f"refused: {result}"
    assert sorted(str(p.relative_to(env.staging)) for p in env.staging.rglob("*")) == [
        "models", "models/m", "models/m/1", "models/m/1/model.bin", "models/m/config.pbtxt",
    ]  # fmt: skip


def test_a_second_trusted_key_is_accepted(env: Env) -> None:
    data = env.manifest(key_id=env.other_trusted.key_id)
    path = Bundle(data, good_members()).write(env.root / "ok.esb", env.other_trusted)
    assert isinstance(env.check(path), Manifest)


def test_hostile_helpers_write_the_members_they_claim(env: Env) -> None:
    path = write_bundle(
        env.root / "kinds.tar",
        [
            symlink("s", "/etc"),
            hardlink("h", "s"),
            chardev("c"),
            blockdev("b"),
            fifo("f"),
            directory("d/", mode=0o1777),
            regular("r", b"x", mode=0o4755),
            regular("p", b"y", pax={"path": "../paxname"}),
            zeros("z", 4096),
        ],
        compress=False,
    )
    with tarfile.open(path) as tar:
        got = {m.name: m for m in tar.getmembers()}
    assert got["s"].issym() and got["s"].linkname == "/etc"
    assert got["h"].islnk() and got["c"].ischr() and got["b"].isblk() and got["f"].isfifo()
    assert got["d"].isdir() and got["d"].mode == 0o1777 and got["r"].mode == 0o4755
    assert "../paxname" in got and got["z"].size == 4096


# ----------------------------------------------------------------------- signature and header level
def test_flipped_bit_in_manifest_after_signing(env: Env) -> None:
    path = Bundle(env.manifest(), good_members()).write(env.root / "b.esb", env.signer, "flipped-manifest")
    env.refused(path, "signature", r"bad signature", extracted=False)


def test_flipped_bit_in_signature(env: Env) -> None:
    path = Bundle(env.manifest(), good_members()).write(env.root / "b.esb", env.signer, "flipped-sig")
    env.refused(path, "signature", r"bad signature", extracted=False)


@pytest.mark.parametrize("tail", ["models", "nothing"])
def test_missing_signature_member(env: Env, tail: str) -> None:
    members = good_members() if tail == "models" else []
    path = Bundle(env.manifest(), members).write(env.root / "b.esb", env.signer, "missing")
    env.refused(path, "signature", r"unsigned|manifest\.sig", extracted=False)


def test_signature_member_that_is_a_symlink(env: Env) -> None:
    body = dump_manifest(env.manifest())
    path = write_bundle(
        env.root / "b.esb", [regular("manifest.json", body), symlink("manifest.sig", "/dev/zero")]
    )
    env.refused(path, "signature", r"manifest\.sig", extracted=False)


def test_signature_by_an_unknown_key(env: Env) -> None:
    path = Bundle(env.manifest(), good_members()).write(
        env.root / "b.esb", env.signer, "unknown-key", intruder=env.intruder
    )
    env.refused(path, "signature", r"unknown key", extracted=False)


def test_signature_by_another_key_claiming_a_trusted_key_id(env: Env) -> None:
    path = Bundle(env.manifest(), good_members()).write(
        env.root / "b.esb", env.signer, "wrong-key", intruder=env.intruder
    )
    env.refused(path, "signature", r"bad signature", extracted=False)


def test_signature_by_the_other_trusted_key_than_declared(env: Env) -> None:
    """Both keys are trusted; the manifest names one and the other signed."""
    body = dump_manifest(env.manifest())
    members = [regular("manifest.json", body), regular("manifest.sig", env.other_trusted.sign(body))]
    path = write_bundle(env.root / "b.esb", [*members, *good_members()])
    env.refused(path, "signature", r"bad signature", extracted=False)


@pytest.mark.parametrize("length", [0, 1, 63, 65, 128, 1000, 5000])
def test_garbage_signature_length(env: Env, length: int) -> None:
    body = dump_manifest(env.manifest())
    garbage = (env.signer.sign(body) * 100)[:length]
    path = write_bundle(
        env.root / "b.esb", [regular("manifest.json", body), regular("manifest.sig", garbage)]
    )
    env.refused(path, "signature", r"64-byte|signature", extracted=False)


def test_no_trusted_key_on_the_device(env: Env) -> None:
    for pub in env.trust_dir.glob("*.pub"):
        pub.unlink()
    path = Bundle(env.manifest(), good_members()).write(env.root / "b.esb", env.signer)
    env.refused(path, "signature", r"no trusted", extracted=False)


@pytest.mark.parametrize("order", ["sig-first", "model-first", "manifest-third"])
def test_manifest_json_not_first(env: Env, order: str) -> None:
    header = signed_header(env.manifest(), env.signer)
    models = good_members()
    members = {
        "sig-first": [header[1], header[0], *models],
        "model-first": [models[0], *header, models[1]],
        "manifest-third": [models[0], models[1], *header],
    }[order]
    path = write_bundle(env.root / "b.esb", members)
    env.refused(path, "format", r"first member.*manifest\.json", extracted=False)


@pytest.mark.parametrize("kind", ["symlink", "directory", "hardlink"])
def test_manifest_json_member_that_is_not_a_regular_file(env: Env, kind: str) -> None:
    first = {
        "symlink": symlink("manifest.json", "/etc/passwd"),
        "directory": directory("manifest.json"),
        "hardlink": hardlink("manifest.json", "models/m/1/model.bin"),
    }[kind]
    sig = regular("manifest.sig", env.signer.sign(dump_manifest(env.manifest())))
    path = write_bundle(env.root / "b.esb", [first, sig, *good_members()])
    env.refused(path, "format", r"manifest\.json", extracted=False)


def test_signed_manifest_that_is_not_json(env: Env) -> None:
    body = b"\xff\xfe not json"
    path = write_bundle(
        env.root / "b.esb", [regular("manifest.json", body), regular("manifest.sig", env.signer.sign(body))]
    )
    env.refused(path, "signature", r"unknown key|signature", extracted=False)


def test_signed_manifest_that_is_a_json_list(env: Env) -> None:
    body = json.dumps([env.manifest()]).encode()
    path = write_bundle(
        env.root / "b.esb", [regular("manifest.json", body), regular("manifest.sig", env.signer.sign(body))]
    )
    env.refused(path, "signature", r"unknown key|signature", extracted=False)


@pytest.mark.parametrize(
    ("field", "value", "words"),
    [
        ("format", 2, r"format"),
        ("version", 0, r"version"),
        ("name", "../evil", r"name"),
        ("expires_at", "tomorrow", r"expires_at"),
        ("created_at", "2025-01-01T00:00:00", r"time zone"),
        ("security_version", -1, r"security_version -1 must be an integer from 0 to 2147483647"),
        ("security_version", 2**31, r"security_version 2147483648 must be"),
        ("security_version", True, r"security_version True must be"),
        ("security_version", 1.0, r"security_version 1\.0 must be"),
        ("security_version", "1", r"security_version '1' must be"),
        ("security_version", None, r"security_version None must be"),
    ],
)
def test_signed_manifest_with_a_bad_field(env: Env, field: str, value: Any, words: str) -> None:
    data = env.manifest()
    data[field] = value
    path = Bundle(data, good_members()).write(env.root / "b.esb", env.signer)
    env.refused(path, "manifest", words, extracted=False)


def test_not_a_bundle_at_all(env: Env) -> None:
    for i, blob in enumerate(
        [b"", b"\x1f", b"\x1f\x8b" + os.urandom(200), os.urandom(4096), b"PK\x03\x04" * 300]
    ):
        path = env.root / f"junk{i}.esb"
        path.write_bytes(blob)
        env.refused(path, ("format", "truncated"), r"bundle|tar|read", extracted=False)


@pytest.mark.parametrize("compress", [True, False], ids=["gz", "tar"])
@pytest.mark.parametrize("size", [archive.MAX_MANIFEST_BYTES + 1, 64 * 2**20], ids=["cap+1", "64MiB"])
def test_oversized_manifest_is_refused_without_reading_it_all(env: Env, compress: bool, size: int) -> None:
    if not compress and size > archive.MAX_MANIFEST_BYTES + 1:
        size = 12 * 2**20  # keep the plain file modest on disk
    data = env.manifest()
    body = dump_manifest(data)
    body = body[:-1] + b" " * (size - len(body)) + b"}"  # valid JSON, just large
    assert len(body) == size
    members = [
        regular("manifest.json", body),
        regular("manifest.sig", env.signer.sign(body)),
        *good_members(),
    ]
    path = write_bundle(env.root / "b.esb", members, compress=compress)
    del body, members
    tracemalloc.start()
    try:
        env.refused(path, "manifest", r"manifest\.json is larger than", extracted=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Bounded by the cap (a few copies of MAX_MANIFEST_BYTES in the tar stream), not by the manifest's size.
    assert peak < 5 * archive.MAX_MANIFEST_BYTES, f"peak {peak} bytes while refusing a {size}-byte manifest"


# ------------------------------------------------------------------------------ truncated downloads
def _sized_bundle(env: Env, model_size: int, compress: bool) -> tuple[Path, int]:
    """A bundle with one random model file; returns (path, uncompressed offset where its data starts)."""
    weights = os.urandom(model_size)
    files = [("models/m/1/model.bin", weights)]
    bundle = Bundle(env.manifest(files), good_members(files))
    plain = bundle.write(env.root / "plain.tar", env.signer, compress=False)
    start = tar_data_offset(plain, "models/m/1/model.bin")
    if not compress:
        return plain, start
    gz = bundle.write(env.root / "full.esb", env.signer, compress=True)
    plain.unlink()
    return gz, start


HEADER_REASONS = ("format", "truncated", "signature", "manifest")


@pytest.mark.parametrize("offset", [0, 1, 2, 5, 9, 10, 11, 20, 60, 120])
def test_gzip_download_cut_inside_the_header(env: Env, offset: int) -> None:
    full, _ = _sized_bundle(env, 3 * 2**20, compress=True)
    cut = truncate(full, env.root / "cut.esb", offset)
    env.refused(cut, HEADER_REASONS, r"bundle|read|end|manifest|signature|corrupt", extracted=False)


@pytest.mark.parametrize(
    "where", ["empty", "first-header", "end-of-first-header", "manifest-data", "sig-header", "sig-data"]
)
def test_tar_download_cut_inside_the_header(env: Env, where: str) -> None:
    full, _ = _sized_bundle(env, 100_000, compress=False)
    manifest_data = tar_data_offset(full, "manifest.json")
    sig_data = tar_data_offset(full, "manifest.sig")
    offset = {
        "empty": 0,
        "first-header": 100,
        "end-of-first-header": manifest_data - 1,
        "manifest-data": manifest_data + 50,
        "sig-header": sig_data - 200,
        "sig-data": sig_data + 10,
    }[where]
    cut = truncate(full, env.root / "cut.esb", offset)
    env.refused(cut, HEADER_REASONS, r"bundle|read|end|manifest|signature|corrupt", extracted=False)


def _cut_points(full: Path, start: int, compress: bool) -> dict[str, int]:
    length = full.stat().st_size
    if compress:  # random data: the compressed model file fills the middle of the file
        return {
            "model-early": length // 2,
            "model-late": length - 64,
            "trailer-1": length - 1,
            "trailer-4": length - 4,
            "trailer-8": length - 8,
        }
    return {"model-early": start + 1, "model-mid": start + 50_000, "model-last-byte": start + 99_999}


@pytest.mark.parametrize(
    ("compress", "where"),
    [
        (False, "model-early"),
        (False, "model-mid"),
        (False, "model-last-byte"),
        (True, "model-early"),
        (True, "model-late"),
        (True, "trailer-1"),
        (True, "trailer-4"),
        (True, "trailer-8"),
    ],
)
def test_download_cut_inside_a_model_file_or_the_gzip_trailer(env: Env, compress: bool, where: str) -> None:
    """A bundle bigger than the reader's 1 MiB chunk: the cut shows while extracting."""
    size = 3 * 2**20 if compress else 100_000
    full, start = _sized_bundle(env, size, compress)
    cut = truncate(full, env.root / "cut.esb", _cut_points(full, start, compress)[where])
    env.refused(cut, "truncated", r"end|corrupt|read|truncat")


@pytest.mark.parametrize("where", ["model-early", "model-late", "trailer-1", "trailer-4", "trailer-8"])
def test_small_gzip_download_cut_is_refused(env: Env, where: str) -> None:
    """Below 1 MiB the whole stream is read when the archive is opened: refused, whatever the label."""
    full, start = _sized_bundle(env, 200_000, compress=True)
    cut = truncate(full, env.root / "cut.esb", _cut_points(full, start, True)[where])
    env.refused(cut, ("truncated", "format"), r"end|corrupt|read|truncat", extracted=False)


@pytest.mark.parametrize("where", ["model-early", "trailer-4"])
def test_small_gzip_download_cut_is_refused_as_truncated(env: Env, where: str) -> None:
    full, start = _sized_bundle(env, 200_000, compress=True)
    cut = truncate(full, env.root / "cut.esb", _cut_points(full, start, True)[where])
    env.refused(cut, "truncated", r"end|corrupt|read|truncat", extracted=False)


@pytest.mark.parametrize("damage", ["cut-1", "cut-8", "trailing-garbage"])
def test_gzip_trailer_damage_on_a_chunk_aligned_bundle(env: Env, damage: str) -> None:
    weights = os.urandom(5 * 2**20)
    target = 5 * 2**20
    size = target - 8192
    while True:  # find the model size whose tar stream is exactly 5 MiB
        files = [("models/m/1/model.bin", weights[:size])]
        bundle = Bundle(env.manifest(files), good_members(files))
        plain = bundle.write(env.root / "plain.tar", env.signer, compress=False)
        if plain.stat().st_size == target:
            break
        assert plain.stat().st_size > target, "no model size gives an aligned tar"
        size -= 512
    full = bundle.write(env.root / "full.esb", env.signer, compress=True)
    data = full.read_bytes()
    damaged = {"cut-1": data[:-1], "cut-8": data[:-8], "trailing-garbage": data + b"garbage!"}[damage]
    path = env.root / "damaged.esb"
    path.write_bytes(damaged)
    env.refused(path, ("truncated", "format"), r"end|corrupt|read|truncat|trail")


# ------------------------------------------------------------------------------------- disk space
@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs (we run as root in the container); skipped with the mount error otherwise."""
    mountpoint = tmp_path / "small-disk"
    mountpoint.mkdir()
    try:
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0755", "tmpfs", str(mountpoint)],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        pytest.skip(f"cannot mount a 1 MiB tmpfs for the disk-full test: {exc}")
    if done.returncode != 0:
        pytest.skip(
            f"cannot mount a 1 MiB tmpfs for the disk-full test: {done.stderr.strip() or done.returncode}"
        )
    try:
        yield mountpoint
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], capture_output=True, timeout=20, check=False)


@pytest.mark.parametrize("compress", [True, False], ids=["gz", "tar"])
def test_disk_full_while_extracting(env: Env, small_tmpfs: Path, compress: bool) -> None:
    weights = os.urandom(3 * 2**20)  # larger than the 1 MiB disk
    files = [("models/m/1/model.bin", weights)]
    path = Bundle(env.manifest(files), good_members(files)).write(
        env.root / "big.esb", env.signer, compress=compress
    )
    env.staging = small_tmpfs / "staging"
    env.refused(path, "disk", r"disk full.*model\.bin")


def test_check_disk_on_the_small_tmpfs(env: Env, small_tmpfs: Path) -> None:
    with pytest.raises(BundleRefused) as info:
        policy.check_disk(
            small_tmpfs / "staging", 2 * 2**20, Policy(disk_margin_bytes=0), "unpacking demo v2"
        )
    assert info.value.reason == "disk" and "\n" not in info.value.message
    assert "unpacking demo v2" in info.value.message
    policy.check_disk(small_tmpfs / "staging", 100_000, Policy(disk_margin_bytes=0), "a small file")


@pytest.mark.parametrize(
    ("free", "refused"), [(0, True), (64 * 2**20 + 999_999, True), (64 * 2**20 + 1_000_000, False)]
)
def test_check_disk_refuses_when_free_space_is_too_small(
    env: Env, monkeypatch: pytest.MonkeyPatch, free: int, refused: bool
) -> None:
    asked: list[Path] = []

    def fake_free(path: Path) -> int:
        asked.append(path)
        return free

    monkeypatch.setattr(policy, "free_bytes", fake_free)
    where = env.root / "state" / "bundles"
    before = snapshot(env.root, env.staging)
    if refused:
        with pytest.raises(BundleRefused) as info:
            policy.check_disk(where, 1_000_000, Policy(), "download of demo v3")
        message = info.value.message
        assert info.value.reason == "disk"
        assert "\n" not in message and re.search(r"not enough disk.*download of demo v3", message), message
        assert str(free) in message
    else:
        policy.check_disk(where, 1_000_000, Policy(), "download of demo v3")
    assert asked == [where]
    assert snapshot(env.root, env.staging) == before


def test_flip_manifest_bit_keeps_json_and_key_id(env: Env) -> None:
    body = dump_manifest(env.manifest())
    flipped = flip_manifest_bit(body)
    assert flipped != body and json.loads(flipped)["key_id"] == env.signer.key_id
    assert flip_bit(flip_bit(body, 3), 3) == body
