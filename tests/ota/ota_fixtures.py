"""Real keys, real bundles of real ONNX models, a device state folder that trusts the key, and the
`edgeserve` command run as a user would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx_models import write_model

from edgeserve.ota.build import BuildRequest, build_bundle
from edgeserve.ota.signing import keygen

ROOT = Path(__file__).resolve().parents[2]
FAST = {"EDGESERVE_OTA_TRIAL_WINDOW_S": "1"}  # a short trial window keeps the tests quick
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


@dataclass
class Fleet:
    """A signing key, and a device state folder that trusts it."""

    tmp: Path
    key: Path
    public: Path
    state: Path

    def repo(self, version: int, models: dict[str, dict[str, object]]) -> Path:
        """A model repository: name -> write_model kwargs (builder, seed, ...)."""
        repo = self.tmp / f"repo-v{version}-{'-'.join(sorted(models))}"
        shutil.rmtree(repo, ignore_errors=True)
        for name, kwargs in models.items():
            write_model(repo, name, **kwargs)  # type: ignore[arg-type]
        return repo

    def bundle(
        self,
        version: int,
        models: dict[str, dict[str, object]] | None = None,
        *,
        name: str = "vision",
        checks: list[dict[str, object]] | None = None,
        extra: dict[str, bytes] | None = None,
        **build: object,
    ) -> Path:
        models = models if models is not None else {"mlp": {"builder": "mlp", "seed": version}}
        repo = self.repo(version, models)
        for path, data in (extra or {}).items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_bytes(data)
        checks_file = None
        if checks is not None:
            checks_file = self.tmp / f"checks-v{version}.json"
            checks_file.write_text(json.dumps(checks))
        out = self.tmp / f"{name}-v{version}.esb"
        build_bundle(BuildRequest(repo, name, version, self.key, out, checks=checks_file, **build))  # type: ignore[arg-type]
        return out


def make_fleet(tmp: Path) -> Fleet:
    private, public, _ = keygen(tmp / "keys", "fleet")
    state = tmp / "state"
    (state / "trust").mkdir(parents=True)
    shutil.copy(public, state / "trust" / "fleet.pub")
    return Fleet(tmp, private, public, state)


def mlp_output(model_file: Path) -> list[float]:
    """What the MLP in this file answers for X, computed in-process (the expected value of checks)."""
    session = ort.InferenceSession(str(model_file), providers=["CPUExecutionProvider"])
    return [float(v) for v in session.run(None, {"INPUT0": X})[0].ravel()]


def mlp_check(
    repo: Path, model: str = "mlp", tolerance: float = 1e-4, wrong: bool = False
) -> dict[str, object]:
    expected = mlp_output(repo / model / "1" / "model.onnx")
    if wrong:
        expected = [v + 0.5 for v in expected]
    return {
        "model": model,
        "tolerance": tolerance,
        "expected": {"OUTPUT0": expected},
        "inputs": [{"name": "INPUT0", "datatype": "FP32", "shape": [1, 16], "data": X.ravel().tolist()}],
    }


def edgeserve(
    *args: str, env: dict[str, str] | None = None, timeout: float = 180, check: bool = False
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", "edgeserve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **FAST, **(env or {})},
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"edgeserve {' '.join(args)} -> {result.returncode}\n{result.stdout}\n{result.stderr}"
        )
    return result


def status(state: Path) -> dict[str, object]:
    return dict(
        json.loads(edgeserve("bundle", "status", "--state-dir", str(state), "--json", check=True).stdout)
    )


def wait_file(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear within {timeout}s")
        time.sleep(0.05)
