"""Attacks through Mender, as someone who can make and even sign Mender artifacts (a Mender server or its
artifact key) but does not hold the fleet's bundle key: the artifact is valid for Mender (its signature
checks with the device's ArtifactVerifyKey, its checksums match), and the bundle inside is still refused
by the device's own Ed25519 check. Refused means: the install fails with the reason, Mender's failure
states run, the store is as before (v1 serves, nothing staged, nothing kept), Mender still names the old
artifact, and nothing is left in the module's hand-over folder. Real mender-client 3.4 in standalone mode."""

from __future__ import annotations

import io
import os
import pwd
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota" / "mender"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ota"))
from mender_env import MenderEnv, fleet_fixture, unavailable, wrap
from ota_fixtures import Fleet, status

from edgeserve.ota.signing import keygen

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))


fleet = fleet_fixture()  # serving vision v1: a copy per test of one install (it costs a trial server)


@pytest.fixture
def env(fleet: Fleet, tmp_path: Path) -> tuple[MenderEnv, Path]:
    """A client that requires artifacts signed by a Mender key, and that key (the attacker holds it)."""
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = tmp_path / "mender-artifact.key", tmp_path / "mender-artifact.pub"
    pem = serialization.Encoding.PEM
    private.write_bytes(key.private_bytes(pem, serialization.PrivateFormat.TraditionalOpenSSL,
                                          serialization.NoEncryption()))  # fmt: skip
    public.write_bytes(key.public_key().public_bytes(pem, serialization.PublicFormat.SubjectPublicKeyInfo))
    client = MenderEnv(tmp_path / "mender", fleet.state)
    client.set_verify_key(public)
    return client, private


def _tampered(fleet: Fleet, tmp: Path) -> Path:
    """A rightly signed bundle with one model file changed after signing (same size)."""
    original = fleet.bundle(2)
    out = tmp / "tampered.esb"
    with tarfile.open(original) as src, tarfile.open(out, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None  # type: ignore[union-attr]
            if data is not None and member.name.endswith("model.onnx"):
                data = data[:-8] + bytes(8)
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    return out


def _assert_nothing_changed(client: MenderEnv, fleet: Fleet, factory: str) -> None:
    after = status(fleet.state)
    assert after["active_version"] == 1 and after["kept_versions"] == [1] and after["state"] == "IDLE"
    assert [h.get("version") for h in after["history"] if h.get("state") == "COMMITTED"] == [1]
    assert not any((fleet.state / "ota" / "staging").iterdir())
    assert not (fleet.state / "mender" / "incoming").exists()  # Cleanup ran
    assert client.artifact_name() == factory


@pytest.mark.parametrize("attack", ["unknown-key", "tampered"])
def test_bundle_refused_inside_a_valid_signed_artifact(
    env: tuple[MenderEnv, Path], fleet: Fleet, tmp_path: Path, attack: str
) -> None:
    client, mender_key = env
    factory = client.artifact_name()
    if attack == "unknown-key":
        stranger, _, _ = keygen(tmp_path / "stranger-keys", "stranger")
        bundle = Fleet(tmp_path / "stranger", stranger, stranger, fleet.state).bundle(2)
        reason = "signed by unknown key"
    else:
        bundle = _tampered(fleet, tmp_path)
        reason = "refused"
    artifact = wrap(bundle, "edge-x86", "--key", str(mender_key))
    result = client.mender("install", str(artifact))
    assert result.returncode != 0
    # Mender took the artifact (its signature and checksums are good): the module's install refused it
    assert "authenticated digital signature of artifact" in result.stderr, result.stderr
    assert "edgeserve-bundle ArtifactInstall: refused" in result.stderr and reason in result.stderr
    _assert_nothing_changed(client, fleet, factory)


def test_an_artifact_with_anything_but_one_bundle_is_refused(env: tuple[MenderEnv, Path], fleet: Fleet,
                                                             tmp_path: Path) -> None:  # fmt: skip
    client, mender_key = env
    factory = client.artifact_name()
    extra = tmp_path / "post-install.sh"
    extra.write_text("#!/bin/sh\nexit 0\n")
    two = tmp_path / "two.mender"
    subprocess.run(["mender-artifact", "write", "module-image", "-T", "edgeserve-bundle", "-t", "edge-x86",
                    "-n", "two", "-f", str(fleet.bundle(2)), "-f", str(extra), "-o", str(two), "-k",
                    str(mender_key)], check=True, capture_output=True)  # fmt: skip
    result = client.mender("install", str(two))
    assert result.returncode != 0 and "exactly one payload file" in result.stderr, result.stderr
    _assert_nothing_changed(client, fleet, factory)


CHILD = """
import io, sys
from pathlib import Path
from edgeserve.ota.mender_module import Device, Module, ModuleConfig, become_owner
state = Path(sys.argv[1])
become_owner(state)
try:
    target = Module(state, Device(ModuleConfig(state, None))).receive(io.BytesIO(b"bundle bytes"))
except PermissionError as exc:
    print("refused", exc)
else:
    print("wrote", target)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (the module runs as root under Mender)")
@pytest.mark.parametrize("planted_link", [False, True])
def test_module_works_as_the_state_folders_owner(planted_link: bool) -> None:
    """The appliance's user owns the state folder and may plant a link in it; root (Mender) must not follow
    it: the module becomes that user before it writes there."""
    nobody = pwd.getpwnam("nobody")
    base = Path(tempfile.mkdtemp(prefix="edgeserve-owner-"))
    try:
        base.chmod(0o755)
        state, root_only = base / "state", base / "root-only"
        state.mkdir()
        root_only.mkdir(mode=0o755)
        (state / "mender").mkdir()
        if planted_link:
            (state / "mender" / "incoming").symlink_to(root_only)
        for path in (state, state / "mender"):
            os.lchown(path, nobody.pw_uid, nobody.pw_gid)
        result = subprocess.run([sys.executable, "-c", CHILD, str(state)], capture_output=True, text=True,
                                check=True, cwd=base)  # fmt: skip
        if planted_link:
            assert result.stdout.startswith("refused"), result.stdout + result.stderr
            assert list(root_only.iterdir()) == []  # nothing written through the link
        else:
            written = state / "mender" / "incoming" / "bundle.esb"
            assert result.stdout.strip() == f"wrote {written}"
            assert written.stat().st_uid == nobody.pw_uid and written.read_bytes() == b"bundle bytes"
    finally:
        shutil.rmtree(base)
