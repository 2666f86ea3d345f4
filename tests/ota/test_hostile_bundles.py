"""Hostile bundles against the device-side check path: every one refused with its own reason.

The path an installer runs, in this order (`check` below): archive.read_header -> signing.verify ->
manifest.parse_manifest -> policy.check_manifest -> archive.extract into a fresh staging folder.
Every archive-level attack is tried with a valid signature by a trusted key (a compromised build
host: the specific reason must come out) and with invalid signatures (reason "signature", and
nothing extracted at all). For every refusal: a BundleRefused with the expected reason, a one-line
message naming the problem, and nothing written outside the staging folder.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import tracemalloc
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hostile import (
    INVALID_SIGNATURES,
    Bundle,
    Member,
    Signer,
    blockdev,
    chardev,
    directory,
    fifo,
    file_entry,
    flip_bit,
    flip_manifest_bit,
    hardlink,
    make_signer,
    make_trust_dir,
    manifest_for,
    raw_member,
    regular,
    signed_header,
    symlink,
    tar_data_offset,
    truncate,
    write_bundle,
    zeros,
)

from edgeserve.ota import archive, build, manifest, policy, signing
from edgeserve.ota.errors import BundleRefused
from edgeserve.ota.manifest import Manifest, dump_manifest
from edgeserve.ota.policy import Policy

MODEL = bytes(range(256)) * 64 + b"weights"  # 16391 bytes
CONFIG = b'name: "m"\nmax_batch_size: 8\n'
FILES = [("models/m/1/model.bin", MODEL), ("models/m/config.pbtxt", CONFIG)]
ARCH = "x86_64"
SIGNATURE_WORDS = r"signature|signed|key"


# ------------------------------------------------------------------------------- the device's path
def check(
    path: Path,
    *,
    trust_dir: Path,
    staging: Path,
    installed: dict[str, int] | None = None,
    policy_: Policy | None = None,
    arch: str = ARCH,
    accelerators: set[str] | None = None,
    now: datetime | None = None,
) -> BundleRefused | Manifest:
    """Steps 1-5 of an install; returns the refusal (any other exception is a bug and propagates)."""
    try:
        body, sig = archive.read_header(path)
        try:  # the installer must not crash on a manifest that is not a JSON object with a key_id
            declared = json.loads(body).get("key_id", "")
        except (ValueError, AttributeError):
            declared = ""
        signing.verify(body, sig, str(declared), trust_dir)
        parsed = manifest.parse_manifest(body)
        policy.check_manifest(
            parsed,
            installed_versions=dict(installed or {}),
            policy=policy_ or Policy(),
            arch=arch,
            accelerators=accelerators,
            now=now,
        )
        archive.extract(path, parsed, staging)
    except BundleRefused as exc:
        return exc
    return parsed


def snapshot(root: Path, exclude: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under `root` (not following links) with type, size, mode and mtime; `exclude` left out."""
    seen: dict[str, tuple[Any, ...]] = {}
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        dirs[:] = [d for d in dirs if here / d != exclude]
        for name in dirs + files:
            full = here / name
            if full == exclude:
                continue
            st = full.lstat()
            if full.is_dir() and not full.is_symlink():  # its listing is covered by the paths below it
                seen[str(full.relative_to(root))] = (st.st_mode,)
            else:
                seen[str(full.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def staged_bytes(staging: Path) -> int:
    if not staging.exists():
        return 0
    return sum(p.lstat().st_size for p in staging.rglob("*") if p.is_file() and not p.is_symlink())


@dataclass
class Env:
    root: Path
    signer: Signer
    other_trusted: Signer
    intruder: Signer
    trust_dir: Path
    staging: Path
    now: datetime

    def check(self, path: Path, **kwargs: Any) -> BundleRefused | Manifest:
        kwargs.setdefault("now", self.now)
        return check(path, trust_dir=self.trust_dir, staging=self.staging, **kwargs)

    def manifest(self, files: Any = FILES, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("key_id", self.signer.key_id)
        kwargs.setdefault("now", self.now)
        return manifest_for(files, **kwargs)

    def outside_path(self, label: str) -> Path:
        """A unique path under tmp_path (outside staging) that an escape would create."""
        return self.root / f"{label}-{uuid.uuid4().hex[:12]}"

    def refused(
        self,
        path: Path,
        reason: str | tuple[str, ...],
        words: str,
        *,
        outside: tuple[Path, ...] | list[Path] = (),
        extracted: bool = True,
        **kwargs: Any,
    ) -> BundleRefused:
        """Run the check and assert a clean refusal; `extracted=False`: staging must not even exist."""
        before = snapshot(self.root, self.staging)
        untouched = {
            p: (p.lstat().st_mode, p.read_bytes() if p.is_file() else None) for p in outside if p.exists()
        }
        result = self.check(path, **kwargs)
        after = snapshot(self.root, self.staging)
        assert isinstance(result, BundleRefused), f"accepted: {result.name} v{result.version}"
        reasons = (reason,) if isinstance(reason, str) else reason
        assert result.reason in reasons, f"reason {result.reason!r}, wanted {reasons}: {result}"
        message = result.message
        assert message and message.strip() == message, repr(message)
        assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
        assert re.search(words, message, re.IGNORECASE), f"{message!r} does not name the problem ({words})"
        assert after == before, f"written outside staging: {set(after) ^ set(before)}"
        for target in outside:
            if target in untouched:
                mode, data = untouched[target]
                assert target.lstat().st_mode == mode
                assert (target.read_bytes() if target.is_file() else None) == data, f"{target} was changed"
            else:
                assert not os.path.lexists(target), f"{target} was created outside staging"
        if not extracted:
            assert not self.staging.exists(), "something was extracted from a bundle that was refused"
        return result


@pytest.fixture
def env(tmp_path: Path) -> Env:
    keys = tmp_path / "keys"
    signer = make_signer(keys, "fleet")
    other = make_signer(keys, "fleet-next")  # also trusted (key rotation)
    intruder = make_signer(keys, "intruder")
    trust = make_trust_dir(tmp_path / "state" / "trust", [signer, other])
    return Env(
        root=tmp_path,
        signer=signer,
        other_trusted=other,
        intruder=intruder,
        trust_dir=trust,
        staging=tmp_path / "state" / "staging",
        now=datetime.now(timezone.utc).replace(microsecond=0),
    )


def good_members(files: list[tuple[str, bytes]] = FILES) -> list[Member]:
    return [regular(path, data) for path, data in files]


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


# ------------------------------------------------------------------ archive attacks x signature kind
@dataclass
class Attack:
    """A bundle body (manifest + members after the header) and the refusal it must earn."""

    manifest: dict[str, Any]
    members: list[Member]
    reason: str | tuple[str, ...]
    words: str
    outside: list[Path] = field(default_factory=list)
    compress: bool = True
    tar_format: int = tarfile.PAX_FORMAT
    cut: Callable[[Path], int] | None = None  # truncate the written bundle at this offset
    max_staged_bytes: int | None = None
    check: dict[str, Any] = field(default_factory=dict)  # installed, policy_, arch, accelerators, now


ATTACKS: dict[str, Callable[[Env], Attack]] = {}
BUGS: dict[str, str] = {}  # attack -> reason; xfail (strict) with a valid signature


def attack(name: str, bug: str | None = None) -> Callable[[Callable[[Env], Attack]], Callable[[Env], Attack]]:
    def register(fn: Callable[[Env], Attack]) -> Callable[[Env], Attack]:
        assert name not in ATTACKS
        ATTACKS[name] = fn
        if bug:
            BUGS[name] = bug
        return fn

    return register


# -- the files against the signed manifest
@attack("hash-mismatch")
def _(env: Env) -> Attack:
    evil = bytes(reversed(MODEL))
    return Attack(env.manifest(), good_members([(FILES[0][0], evil), FILES[1]]), "hash", r"sha256.*differs")


@attack("size-mismatch-larger")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), good_members([(FILES[0][0], MODEL + b"!"), FILES[1]]), "size", r"bytes")


@attack("size-mismatch-smaller")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), good_members([(FILES[0][0], MODEL[:-1]), FILES[1]]), "size", r"bytes")


@attack("manifest-size-lies")
def _(env: Env) -> Attack:
    entries = [file_entry(FILES[0][0], MODEL, size=len(MODEL) - 7), file_entry(*FILES[1])]
    return Attack(env.manifest(entries), good_members(), "size", r"bytes")


@attack("file-missing-from-archive")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), good_members()[:1], "missing", r"not in the archive.*config\.pbtxt")


@attack("extra-file-not-in-manifest")
def _(env: Env) -> Attack:
    members = [*good_members(), regular("models/m/1/extra.so", b"\x7fELF")]
    return Attack(env.manifest(), members, "extra", r"extra\.so.*not in the signed manifest")


@attack("extra-file-outside-models")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [*good_members(), regular("run.sh", b"#!/bin/sh\n")], "path", r"run\.sh")


@attack("truncated-inside-model-file")
def _(env: Env) -> Attack:
    def cut(path: Path) -> int:
        return tar_data_offset(path, "models/m/1/model.bin") + 1000

    return Attack(env.manifest(), good_members(), "truncated", r"end|truncat", compress=False, cut=cut)


# -- policy on a well-signed manifest
@attack("downgrade")
def _(env: Env) -> Attack:
    return Attack(
        env.manifest(version=4),
        good_members(),
        "downgrade",
        r"v4.*older.*v5",
        check={"installed": {"demo": 5}},
    )


@attack("replay")
def _(env: Env) -> Attack:
    return Attack(
        env.manifest(version=5),
        good_members(),
        "replay",
        r"v5.*already installed",
        check={"installed": {"demo": 5}},
    )


@attack("expired")
def _(env: Env) -> Attack:
    data = env.manifest(expires_at=env.now + timedelta(days=1))
    return Attack(
        data, good_members(), "expired", r"expired", check={"now": env.now + timedelta(days=1, seconds=1)}
    )


@attack("expired-long-ago")
def _(env: Env) -> Attack:
    data = env.manifest(created_at=env.now - timedelta(days=400), expires_at=env.now - timedelta(days=300))
    return Attack(data, good_members(), "expired", r"expired")


@attack("incompatible-arch")
def _(env: Env) -> Attack:
    return Attack(
        env.manifest(arch=["aarch64", "armv7l"]), good_members(), "incompatible", r"aarch64.*x86_64"
    )


@attack("incompatible-accelerators")
def _(env: Env) -> Attack:
    data = env.manifest(accelerators=["tensorrt"])
    return Attack(data, good_members(), "incompatible", r"tensorrt", check={"accelerators": {"openvino"}})


@attack("incompatible-accelerators-none")
def _(env: Env) -> Attack:
    return Attack(env.manifest(accelerators=["cuda"]), good_members(), "incompatible", r"cuda.*none")


@attack("min-edgeserve-too-high")
def _(env: Env) -> Attack:
    return Attack(
        env.manifest(min_edgeserve="99.0.0"), good_members(), "incompatible", r"edgeserve >= 99\.0\.0"
    )


@attack("unpacked-size-over-policy")
def _(env: Env) -> Attack:
    return Attack(
        env.manifest(),
        good_members(),
        "oversized",
        r"over the policy cap",
        check={"policy_": Policy(max_unpacked_bytes=len(MODEL))},
    )


@attack("unpacked-size-over-default-policy")
def _(env: Env) -> Attack:
    entries = [file_entry(FILES[0][0], MODEL, size=Policy().max_unpacked_bytes + 1)]
    return Attack(env.manifest(entries), good_members(FILES[:1]), "oversized", r"over the policy cap")


@attack("file-count-over-policy")
def _(env: Env) -> Attack:
    files = [(f"models/m/1/part{i:03d}.bin", bytes([i])) for i in range(11)]
    return Attack(
        env.manifest(files),
        good_members(files),
        "oversized",
        r"11 files.*cap of 10",
        check={"policy_": Policy(max_files=10)},
    )


# -- a manifest that is valid JSON but lies
@attack("manifest-unpacked-size-lies")
def _(env: Env) -> Attack:
    return Attack(env.manifest(unpacked_size=10), good_members(), "manifest", r"unpacked_size")


@attack("manifest-path-dotdot")
def _(env: Env) -> Attack:
    entries = [file_entry("models/m/../../etc/cron.d/x", b"x"), file_entry(*FILES[1])]
    return Attack(env.manifest(entries, models={"m": [1]}), good_members(), "path", r"\.\.")


@attack("manifest-path-absolute")
def _(env: Env) -> Attack:
    entries = [file_entry("/etc/passwd", b"x")]
    return Attack(env.manifest(entries, models={"m": [1]}), good_members(), "path", r"absolute")


@attack("manifest-lists-a-file-twice")
def _(env: Env) -> Attack:
    entries = [file_entry(*FILES[0]), file_entry(*FILES[0]), file_entry(*FILES[1])]
    return Attack(env.manifest(entries), good_members(), "duplicate", r"twice")


@attack("manifest-file-of-an-unlisted-model")
def _(env: Env) -> Attack:
    return Attack(env.manifest(models={"other": [1]}), good_members(), "manifest", r"belongs to no model")


# -- names
@attack("absolute-path-member")
def _(env: Env) -> Attack:
    target = env.outside_path("abs-target")
    members = [regular(str(target), b"pwned"), *good_members()]
    return Attack(env.manifest(), members, "path", r"absolute", outside=[target])


@attack("absolute-path-member-outside-tmp")
def _(env: Env) -> Attack:
    target = Path(tempfile.gettempdir()) / f"edgeserve-hostile-{uuid.uuid4().hex}"
    members = [regular(str(target), b"pwned"), *good_members()]
    return Attack(env.manifest(), members, "path", r"absolute", outside=[target])


@attack("dotdot-member")
def _(env: Env) -> Attack:
    target = env.outside_path("dotdot-target")  # staging is root/state/staging: ../../x is root/x
    members = [regular(f"../../{target.name}", b"pwned"), *good_members()]
    return Attack(
        env.manifest(), members, "path", r"\.\.", outside=[target, env.root / "state" / target.name]
    )


@attack("models-dotdot-member")
def _(env: Env) -> Attack:
    target = env.outside_path("models-dotdot")
    names = [f"models/../../{target.name}", f"models/m/1/../../../../{target.name}"]
    members = [*good_members(), *(regular(n, b"pwned") for n in names)]
    outside = [target, env.root / "state" / target.name]
    return Attack(env.manifest(), members, "path", r"\.\.", outside=outside)


@attack("dotdot-listed-in-manifest-too")
def _(env: Env) -> Attack:
    """The signed manifest itself lists the escaping path: refused at parse time."""
    target = env.outside_path("listed-dotdot")
    name = f"models/m/../../../{target.name}"
    files = [*FILES, (name, b"pwned")]
    return Attack(
        env.manifest(files, models={"m": [1]}), good_members(files), "path", r"\.\.", outside=[target]
    )


@attack("pax-path-override-dotdot")
def _(env: Env) -> Attack:
    target = env.outside_path("pax-target")
    members = [
        regular("models/m/1/innocent.bin", b"pwned", pax={"path": f"../../{target.name}"}),
        *good_members(),
    ]
    return Attack(env.manifest(), members, "path", r"\.\.", outside=[target])


@attack("pax-path-override-absolute")
def _(env: Env) -> Attack:
    target = env.outside_path("pax-abs")
    members = [regular("models/m/1/innocent.bin", b"pwned", pax={"path": str(target)}), *good_members()]
    return Attack(env.manifest(), members, "path", r"absolute", outside=[target])


@attack("pax-size-override")
def _(env: Env) -> Attack:
    """A pax record claims another size than the ustar header and the manifest."""
    members = [regular(FILES[0][0], MODEL, pax={"size": "-1"}), *good_members()[1:]]
    return Attack(env.manifest(), members, ("size", "truncated", "format"), r"bytes|end|read")


@attack("gnu-longname-dotdot")
def _(env: Env) -> Attack:
    target = env.outside_path("gnu-long")
    name = "models/m/1/" + "a" * 120 + "/../../../../../" + target.name
    members = [*good_members(), regular(name, b"pwned")]
    return Attack(env.manifest(), members, "path", r"\.\.", outside=[target], tar_format=tarfile.GNU_FORMAT)


@attack("directory-member-dotdot")
def _(env: Env) -> Attack:
    target = env.outside_path("dir-escape")
    members = [directory(f"models/../../{target.name}/"), *good_members()]
    return Attack(env.manifest(), members, "path", r"\.\.|plain relative|outside", outside=[target])


@attack("directory-member-absolute")
def _(env: Env) -> Attack:
    target = env.outside_path("dir-abs")
    members = [directory(f"{target}/"), *good_members()]
    return Attack(env.manifest(), members, "path", r"relative|absolute|outside", outside=[target])


# -- links, devices, odd types and modes
@attack("symlink-member")
def _(env: Env) -> Attack:
    target = env.outside_path("symlink-target")
    target.write_bytes(b"precious")
    members = [*good_members(), symlink("models/m/1/model.link", str(target))]
    return Attack(env.manifest(), members, "link", r"symlink", outside=[target])


@attack("symlink-then-write-through-it")
def _(env: Env) -> Attack:
    outside_dir = env.outside_path("symlink-dir")
    outside_dir.mkdir()
    files = [*FILES, ("models/m/1/d/pwn.bin", b"pwned")]
    members = [symlink("models/m/1/d", str(outside_dir)), *good_members(files)]
    return Attack(
        env.manifest(files), members, "link", r"symlink", outside=[outside_dir, outside_dir / "pwn.bin"]
    )


@attack("symlink-relative-escape")
def _(env: Env) -> Attack:
    members = [symlink("models/m/1/up", "../../../../.."), *good_members()]
    return Attack(env.manifest(), members, "link", r"symlink")


@attack("hardlink-member")
def _(env: Env) -> Attack:
    target = env.outside_path("hardlink-target")
    target.write_bytes(b"precious")
    members = [*good_members(), hardlink("models/m/1/model.hl", str(target))]
    return Attack(env.manifest(), members, "link", r"hard link", outside=[target])


@attack("hardlink-to-listed-file")
def _(env: Env) -> Attack:
    files = [*FILES, ("models/m/1/copy.bin", MODEL)]
    members = [*good_members(), hardlink("models/m/1/copy.bin", FILES[0][0])]
    return Attack(env.manifest(files), members, "link", r"hard link")


@attack("char-device")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [chardev("models/m/1/null"), *good_members()], "device", r"device")


@attack("block-device")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [*good_members(), blockdev("models/m/1/sda")], "device", r"device")


@attack("fifo")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [fifo("models/m/1/pipe"), *good_members()], "device", r"FIFO")


@attack("unknown-member-type")
def _(env: Env) -> Attack:
    info = tarfile.TarInfo("models/m/1/odd")
    info.type, info.size, info.mode = b"Z", 3, 0o644
    return Attack(env.manifest(), [raw_member(info, b"odd"), *good_members()], "type", r"not a regular file")


@attack("setuid-file")
def _(env: Env) -> Attack:
    members = [regular(FILES[0][0], MODEL, mode=0o4755), *good_members()[1:]]
    return Attack(env.manifest(), members, "setuid", r"setuid")


@attack("setgid-file")
def _(env: Env) -> Attack:
    members = [regular(FILES[0][0], MODEL, mode=0o2755), *good_members()[1:]]
    return Attack(env.manifest(), members, "setuid", r"setgid")


@attack("setuid-setgid-sticky-directory")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [directory("models/m/", mode=0o7777), *good_members()], "setuid", r"sticky")


# -- duplicates
@attack("same-file-twice")
def _(env: Env) -> Attack:
    return Attack(env.manifest(), [*good_members(), good_members()[0]], "duplicate", r"twice")


@attack("same-file-twice-different-content")
def _(env: Env) -> Attack:
    members = [*good_members(), regular(FILES[0][0], bytes(len(MODEL)))]
    return Attack(env.manifest(), members, "duplicate", r"twice")


@attack("folder-then-file-same-name")
def _(env: Env) -> Attack:
    """The folder comes first: no listed file lies under it, so it is refused before the clash."""
    members = [directory(FILES[0][0] + "/"), *good_members()]
    return Attack(env.manifest(), members, "extra", r"folder models/m/1/model\.bin.*no file of the signed")


@attack("file-then-folder-same-name")
def _(env: Env) -> Attack:
    members = [*good_members(), directory(FILES[0][0] + "/")]
    return Attack(env.manifest(), members, "duplicate", r"twice")


@attack("file-then-folder-inside-it")
def _(env: Env) -> Attack:
    members = [*good_members(), directory(FILES[0][0] + "/sub/")]
    return Attack(env.manifest(), members, ("duplicate", "path", "type", "extra"), r"model\.bin")


@attack("folder-inside-then-file")
def _(env: Env) -> Attack:
    members = [directory(FILES[0][0] + "/sub/"), *good_members()]
    return Attack(env.manifest(), members, ("duplicate", "path", "type", "extra"), r"model\.bin")


@attack("manifest-lists-a-file-and-a-file-below-it")
def _(env: Env) -> Attack:
    files = [("models/m/1/a", b"first"), ("models/m/1/a/b", b"second")]
    return Attack(
        env.manifest(files), good_members(files), ("duplicate", "path", "manifest"), r"models/m/1/a"
    )


# -- bombs
@attack("bomb-compressible-file-declared-small")
def _(env: Env) -> Attack:
    small = bytes(16)
    files = [("models/m/1/model.bin", small)]
    members = [zeros("models/m/1/model.bin", 64 * 2**20)]  # 64 MiB of zeros, ~64 KiB gzipped
    return Attack(env.manifest(files), members, ("bomb", "size"), r"bytes", max_staged_bytes=64 * 1024)


@attack("bomb-pax-header")
def _(env: Env) -> Attack:
    members = [*good_members(), regular("models/m/1/x", b"x", pax={"comment": "A" * 16 * 2**20})]
    return Attack(
        env.manifest(), members, "bomb", r"expands past", max_staged_bytes=len(MODEL) + len(CONFIG) + 1
    )


@attack("bomb-many-folders")
def _(env: Env) -> Attack:
    """Folders no listed file needs: the first one is refused (the decompression cap would stop the rest)."""
    members = [*good_members(), *(directory(f"models/m/1/d{i:05d}/") for i in range(12_000))]
    return Attack(
        env.manifest(),
        members,
        "extra",
        r"d00000.*no file of the signed",
        max_staged_bytes=len(MODEL) + len(CONFIG) + 1,
    )


def _attack_params() -> list[Any]:
    params = []
    for name in ATTACKS:
        for mode in ("valid", "wrong-key", "unknown-key", "flipped-manifest"):
            marks = []
            if mode == "valid" and name in BUGS:
                marks.append(pytest.mark.xfail(strict=True, reason=BUGS[name]))
            params.append(pytest.param(name, mode, marks=marks, id=f"{name}-{mode}"))
    return params


@pytest.mark.parametrize(("name", "mode"), _attack_params())
def test_archive_attack(env: Env, name: str, mode: str) -> None:
    assert mode in ("valid", *INVALID_SIGNATURES)
    spec = ATTACKS[name](env)
    path = Bundle(spec.manifest, spec.members).write(
        env.root / "bundle.esb",
        env.signer,
        mode,
        intruder=env.intruder,
        compress=spec.compress,
        tar_format=spec.tar_format,
    )
    if spec.cut is not None:
        truncate(path, path, spec.cut(path))
    if mode == "valid":
        env.refused(path, spec.reason, spec.words, outside=spec.outside, **spec.check)
    else:
        env.refused(path, "signature", SIGNATURE_WORDS, outside=spec.outside, extracted=False, **spec.check)
    if spec.max_staged_bytes is not None:
        assert staged_bytes(env.staging) < spec.max_staged_bytes


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
