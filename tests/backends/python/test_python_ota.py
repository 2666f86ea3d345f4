"""A Python model in a signed OTA bundle installs and passes its trial (model.py goes through the
bundle's signed manifest like any model file); the same bundle with model.py changed after signing is
refused before anything is staged."""

from __future__ import annotations

import io
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "ota"))

from ota_fixtures import Fleet, make_fleet
from pymodels import ADD_SUB, ADD_SUB_CONFIG

from edgeserve.ota.installer import Installer
from edgeserve.ota.store import Store
from edgeserve.supervisor.activate import OfflineActivator, TrialRunner

pytestmark = pytest.mark.timeout(180)

FILES = {"add_sub/config.pbtxt": ADD_SUB_CONFIG.encode(), "add_sub/1/model.py": ADD_SUB.encode()}


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return make_fleet(tmp_path)


def _installer(fleet: Fleet) -> Installer:
    return Installer(Store(fleet.state), OfflineActivator(TrialRunner(fleet.state, None, window_s=0.5)))


def test_a_signed_bundle_with_a_python_model_installs(fleet: Fleet) -> None:
    bundle = fleet.bundle(1, extra=FILES)
    outcome = _installer(fleet).install(str(bundle), lambda *a: None)
    assert outcome.ok and outcome.state == "COMMITTED", outcome
    active = Store(fleet.state).active()
    assert active is not None
    assert (active.path / "models" / "add_sub" / "1" / "model.py").read_bytes() == FILES["add_sub/1/model.py"]


def test_model_py_changed_after_signing_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    bundle = fleet.bundle(1, extra=FILES)
    tampered = tmp_path / "tampered.esb"
    evil = b"import os\nos.system('echo pwned')\n" + FILES["add_sub/1/model.py"]
    with tarfile.open(bundle) as source, tarfile.open(tampered, "w", format=tarfile.PAX_FORMAT) as out:
        for member in source.getmembers():
            handle = source.extractfile(member) if member.isreg() else None
            data = handle.read() if handle is not None else b""
            if member.name == "models/add_sub/1/model.py":
                data = evil[: len(data)]  # the same size: only the hash can tell
            out.addfile(member, io.BytesIO(data) if member.isreg() else None)
    outcome = _installer(fleet).install(str(tampered), lambda *a: None)
    assert not outcome.ok and outcome.state == "FAILED", outcome
    assert "refused" in outcome.reason and "model.py" in outcome.reason, outcome.reason
    assert Store(fleet.state).active() is None
