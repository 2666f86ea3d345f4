"""INT8 results and calibration samples in bundles, attacked: a swapped calibration sample or INT8 model
inside a signed bundle is refused by `bundle verify` (the manifest's hashes cover them like every file);
`bundle build --calibration` refuses a symlinked sample and writes no bundle; a calibration sample that
carries a pickle never runs it (`tune --int8` refuses the file with a one-line reason)."""

from __future__ import annotations

import io
import shutil
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))  # tests/bench/int8_cnn.py

from int8_cnn import clear_inputs, write_repository

from edgeserve.cli import main


def _keys(tmp: Path) -> tuple[Path, Path]:
    assert main(["keygen", "--out", str(tmp / "keys")]) == 0
    trust = tmp / "trust"
    trust.mkdir()
    shutil.copy(tmp / "keys" / "edgeserve.pub", trust)
    return tmp / "keys" / "edgeserve.key", trust


def _bundle(tmp: Path, key: Path) -> tuple[Path, Path]:
    """A repository whose cnn carries an INT8 file (as `tune --int8 --apply` leaves it), bundled with
    calibration samples."""
    model_dir = write_repository(tmp / "repo", warmup=False)
    shutil.copy(model_dir / "1" / "model.onnx", model_dir / "1" / "model_int8.onnx")
    samples = tmp / "samples"
    samples.mkdir()
    np.save(samples / "crops.npy", clear_inputs(model_dir / "1" / "model.onnx", 4, seed=1))
    out = tmp / "cnn.esb"
    assert main(["bundle", "build", str(tmp / "repo"), "--name", "cnn", "--version", "1", "--key", str(key),
                 "--out", str(out), "--calibration", f"cnn={samples}", "--no-gzip"]) == 0  # fmt: skip
    return out, model_dir


def _swap(bundle: Path, member: str, out: Path) -> None:
    """The bundle with one member's bytes replaced by others of the same size (manifest and signature
    kept): what someone without the signing key can do on the way to the device."""
    with tarfile.open(bundle) as src, tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as dst:
        for info in src.getmembers():
            data = src.extractfile(info).read() if info.isfile() else b""  # type: ignore[union-attr]
            if info.name == member:
                data = bytes(b ^ 0x01 for b in data[:64]) + data[64:]  # poisoned ranges / weights
            dst.addfile(info, io.BytesIO(data) if info.isfile() else None)


@pytest.mark.parametrize("member", ["models/cnn/calibration/crops.npy", "models/cnn/1/model_int8.onnx"])
def test_a_swapped_calibration_sample_or_int8_model_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], member: str
) -> None:
    key, trust = _keys(tmp_path)
    bundle, _ = _bundle(tmp_path, key)
    assert main(["bundle", "verify", str(bundle), "--trust", str(trust)]) == 0
    capsys.readouterr()
    tampered = tmp_path / "tampered.esb"
    _swap(bundle, member, tampered)
    before = set(Path("/tmp").glob("edgeserve-verify-*"))
    assert main(["bundle", "verify", str(tampered), "--trust", str(trust)]) == 1
    err = capsys.readouterr().err
    assert "refused" in err and member.rsplit("/", 1)[-1] in err and len(err.strip().splitlines()) == 1
    assert set(Path("/tmp").glob("edgeserve-verify-*")) == before  # nothing extracted is left behind


def test_build_refuses_a_symlinked_calibration_sample(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    key, _ = _keys(tmp_path)
    write_repository(tmp_path / "repo", warmup=False)
    samples = tmp_path / "samples"
    samples.mkdir()
    secret = tmp_path / "secret.npy"
    np.save(secret, np.zeros((1, 3, 32, 32), np.float32))
    (samples / "crops.npy").symlink_to(secret)  # would pack a file from outside the samples folder
    out = tmp_path / "cnn.esb"
    assert main(["bundle", "build", str(tmp_path / "repo"), "--name", "cnn", "--version", "1", "--key",
                 str(key), "--out", str(out), "--calibration", f"cnn={samples}"]) == 1  # fmt: skip
    assert "crops.npy is a symlink: bundles carry regular files only" in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob("*.tmp"))


class _Payload:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (Path.touch, (str(MARKER),))


MARKER = Path("/nonexistent")


def test_a_pickled_calibration_sample_never_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    global MARKER
    MARKER = tmp_path / "ran"
    model_dir = write_repository(tmp_path / "repo", warmup=False)
    (model_dir / "calibration").mkdir()  # as an installed bundle's model folder holds it
    np.save(model_dir / "calibration" / "evil.npy", np.array([_Payload()], dtype=object), allow_pickle=True)
    before = sorted(p.name for p in model_dir.rglob("*"))
    args = ["tune", "cnn", "--model-repository", str(tmp_path / "repo"), "--int8", "--calibration-source",
            "bundle", "--out-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("edgeserve tune: calibration sample ") and "evil.npy" in err[-1]
    assert "not a plain numeric array" in err[-1]
    assert not MARKER.exists()
    assert sorted(p.name for p in model_dir.rglob("*")) == before and not (tmp_path / "out" / "int8").exists()
