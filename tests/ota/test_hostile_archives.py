"""Archive-level attacks against the device-side check path (hostile_check.py): the files against the
signed manifest, policy, lying manifests, names, links and odd member types, duplicates, bombs.

Every attack is tried with a valid signature by a trusted key (a compromised build host: the specific
reason must come out) and with invalid signatures (reason "signature", and nothing extracted at all).
"""

from __future__ import annotations

import sys
import tarfile
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from hostile import (
    INVALID_SIGNATURES,
    Bundle,
    Member,
    blockdev,
    chardev,
    directory,
    fifo,
    file_entry,
    hardlink,
    raw_member,
    regular,
    symlink,
    tar_data_offset,
    truncate,
    zeros,
)
from hostile_check import CONFIG, FILES, MODEL, SIGNATURE_WORDS, Env, good_members, staged_bytes

from edgeserve.ota.manifest import Manifest
from edgeserve.ota.policy import Policy


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
def version_attack(name: str, version: int, pattern: str) -> None:
    """Bundle `version` of demo offered to a device that has demo v5 installed: refused as `name`."""

    @attack(name)
    def _(env: Env) -> Attack:
        return Attack(
            env.manifest(version=version), good_members(), name, pattern, check={"installed": {"demo": 5}}
        )


version_attack("downgrade", 4, r"v4.*older.*v5")
version_attack("replay", 5, r"v5.*already installed")


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
    """A pax record claims another size than the ustar header and the manifest. tarfile releases with
    the 2025 pax-header fixes (CPython 3.11.13+, Debian's 3.11.2-6+deb12u8) end the archive at such a
    header without an error, so there the manifest's files are missing: refused all the same."""
    members = [regular(FILES[0][0], MODEL, pax={"size": "-1"}), *good_members()[1:]]
    reasons = ("size", "truncated", "format", "missing")
    return Attack(env.manifest(), members, reasons, r"bytes|end|read|not in the archive")


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
def link_out_attack(kind: str, link: Callable[[str, str], Member], name: str, words: str) -> None:
    """A `kind` member `name` to a file outside the install folder, which must stay as it was."""

    @attack(f"{kind}-member")
    def _(env: Env) -> Attack:
        target = env.outside_path(f"{kind}-target")
        target.write_bytes(b"precious")
        members = [*good_members(), link(name, str(target))]
        return Attack(env.manifest(), members, "link", words, outside=[target])


link_out_attack("symlink", symlink, "models/m/1/model.link", r"symlink")


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


link_out_attack("hardlink", hardlink, "models/m/1/model.hl", r"hard link")


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
    _attempt(env, ATTACKS[name](env), mode)


# ------------------------------------------------- the same attacks on a Python without data_filter
@pytest.mark.parametrize("name", [name for name in ATTACKS if name not in BUGS])
def test_archive_attack_without_data_filter(env: Env, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Debian 12 / Raspberry Pi OS bookworm's Python 3.11.2 has no tarfile.data_filter (3.11.4): our own
    allowlist alone refuses every attack, for the same reason. Hidden here, so it shows on any Python."""
    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    _attempt(env, ATTACKS[name](env), "valid")


@pytest.mark.parametrize("hide", [True, False], ids=["without-data-filter", "as-this-python-is"])
def test_good_bundle_extracts_with_or_without_data_filter(
    env: Env, hide: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where data_filter exists it vets every member on top of ours; where it does not, installs work."""
    real = getattr(tarfile, "data_filter", None)
    if not hide and real is None:
        pytest.skip(f"Python {sys.version.split()[0]} has no tarfile.data_filter")
    vetted: list[str] = []

    def watched(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo:
        vetted.append(member.name)
        assert real is not None
        return real(member, dest)  # type: ignore[no-any-return]

    if hide:
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    else:
        monkeypatch.setattr(tarfile, "data_filter", watched)
    members = [directory("models/m/"), *good_members()]
    result = env.check(Bundle(env.manifest(), members).write(env.root / "ok.esb", env.signer))
    assert isinstance(result, Manifest), f"refused: {result}"
    for name, data in FILES:
        assert (env.staging / name).read_bytes() == data
    assert vetted == ([] if hide else ["models/m", *(name for name, _ in FILES)])


def _attempt(env: Env, spec: Attack, mode: str) -> None:
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
