"""How a verified bundle is tried and switched in: a trial server (a second `edgeserve serve` on a
private socket) loads, warms up and checks the new models while the running server keeps serving the
old ones; after the link switch the running server reloads them through its own repository API.

The installer (ota/installer.py) sees these as its `Activator`; they run server processes, the
supervisor's trade (child.py, control.py), both under the supervisor and offline (`edgeserve bundle
install` with no appliance running)."""

from __future__ import annotations

import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from edgeserve.fsutil import private_mkdir
from edgeserve.ota.installer import Report, TrialFailed
from edgeserve.ota.manifest import Check, Manifest, parse_manifest
from edgeserve.ota.store import LOADING, TRIAL, Version
from edgeserve.supervisor.child import ServerProcess
from edgeserve.supervisor.control import ServerControl, ServerUnreachable

log = logging.getLogger("edgeserve.ota")

PROCESS_BASELINE_BYTES = 250 * 2**20  # a server process before its models (Python, runtimes)


def available_memory() -> int | None:
    """MemAvailable, bounded by the cgroup v2 limit when there is one."""
    available: int | None = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            left = int(limit) - used
            available = left if available is None else min(available, left)
    except (OSError, ValueError):
        pass
    return available


def trial_memory_bytes(models_dir: Path) -> int:
    """A second resident copy: about twice the model files (weights + runtime buffers) plus a process."""
    files = sum(f.stat().st_size for f in models_dir.rglob("*") if f.is_file())
    return 2 * files + PROCESS_BASELINE_BYTES


def _close(value: Any, expected: Any, tolerance: float) -> bool:
    if isinstance(expected, (int, float)) and isinstance(value, (int, float)):
        if math.isnan(expected):
            return math.isnan(value)
        return abs(value - expected) <= tolerance * (1 + abs(expected))
    return bool(value == expected)


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list):
        return [item for value in values for item in _flat(value)]
    return [values]


def run_checks(control: ServerControl, checks: list[Check]) -> None:
    """The bundle's sample requests: every output within its tolerance, or TrialFailed naming it."""
    for index, check in enumerate(checks):
        try:
            status, body = control.request(
                "POST", f"/v2/models/{check.model}/infer", {"inputs": check.inputs}
            )
        except ServerUnreachable as exc:
            raise TrialFailed(f"check {index} ({check.model}): no answer: {exc}") from None
        if status != 200 or not isinstance(body, dict):
            raise TrialFailed(f"check {index} ({check.model}): HTTP {status}: {body}")
        outputs = {
            o.get("name"): _flat(o.get("data", [])) for o in body.get("outputs", []) if isinstance(o, dict)
        }
        for name, expected in check.expected.items():
            got = outputs.get(name)
            flat = _flat(expected)
            if got is None or len(got) != len(flat):
                raise TrialFailed(f"check {index} ({check.model}): output {name} missing or of another size")
            worst = max(
                (i for i in range(len(flat)) if not _close(got[i], flat[i], check.tolerance)), default=None
            )
            if worst is not None:
                raise TrialFailed(f"check {index} ({check.model}): {name}[{worst}] = {got[worst]}, "
                                  f"expected {flat[worst]} within {check.tolerance}")  # fmt: skip


class TrialRunner:
    """Loads a models folder in a separate `edgeserve serve` (no listeners but a private socket)."""

    def __init__(self, state_dir: Path, config: Path | None, *, load_timeout_s: float = 900.0,
                 window_s: float = 5.0, log_line: Any = None) -> None:  # fmt: skip
        self.state_dir = state_dir
        self.config = config
        self.load_timeout_s = load_timeout_s
        self.window_s = window_s
        self.log_line = log_line or (lambda line: log.info("trial: %s", line))

    def __call__(self, models_dir: Path, manifest: Manifest, report: Report) -> None:
        work = self.state_dir / "ota" / "trial"
        private_mkdir(work)
        args = ["--model-repository", str(models_dir), "--no-http", "--no-grpc", "--no-zmq",
                "--model-control-mode", "explicit", "--load-model", "*"]  # fmt: skip
        if self.config is not None:
            args = ["--config", str(self.config), *args]
        cache = os.environ.get("EDGESERVE_RUNTIME_CACHE_DIR") or str(self.state_dir / "cache")
        server = ServerProcess(args, work / "trial.sock", work / "state", self.log_line,
                               extra_env={"EDGESERVE_RUNTIME_CACHE_DIR": cache})  # fmt: skip
        try:
            control = ServerControl(work / "trial.sock", 5.0)
            wait_serving(control, set(manifest.models), self.load_timeout_s, LOADING, report,
                         alive=lambda: server.poll() is None)  # fmt: skip
            report(
                TRIAL, None, f"{len(manifest.checks)} check(s), then {self.window_s:.0f}s of health checks"
            )
            run_checks(control, manifest.checks)
            watch(control, set(manifest.models), self.window_s, alive=lambda: server.poll() is None)
        finally:
            server.stop(10.0)
            (work / "trial.sock").unlink(missing_ok=True)


def wait_serving(control: ServerControl, names: set[str], timeout_s: float, state: str, report: Report,
                 alive: Any = lambda: True) -> None:  # fmt: skip
    """Until every model in `names` is READY; TrialFailed when one fails or the server dies."""
    deadline = time.monotonic() + timeout_s
    last = -1
    while time.monotonic() < deadline:
        if not alive():
            raise TrialFailed("the server exited while loading the new models")
        try:
            view = control.view()
        except ServerUnreachable:
            time.sleep(0.2)
            continue
        ready = {m.name for m in view.models if m.name in names and m.state == "READY"}
        failed = [m for m in view.models if m.name in names - ready and m.state == "UNAVAILABLE"]
        if failed:
            raise TrialFailed(f"{failed[0].name} did not load: {failed[0].reason or 'unavailable'}")
        if len(ready) != last:
            last = len(ready)
            report(state, len(ready) / max(len(names), 1), f"{len(ready)}/{len(names)} models ready")
        if ready >= names:
            return
        time.sleep(0.2)
    raise TrialFailed(f"the new models were not ready within {timeout_s:.0f}s")


def watch(control: ServerControl, names: set[str], window_s: float, alive: Any = lambda: True) -> None:
    """Health checks for `window_s`: the server stays up and every model stays READY."""
    deadline = time.monotonic() + window_s
    while time.monotonic() < deadline:
        if not alive():
            raise TrialFailed("the server exited during the trial window")
        try:
            view = control.view()
        except ServerUnreachable as exc:
            raise TrialFailed(f"the server stopped answering during the trial window: {exc}") from None
        ready = {m.name for m in view.models if m.state == "READY"}
        if not names <= ready:
            raise TrialFailed(
                f"{', '.join(sorted(names - ready))} stopped being ready during the trial window"
            )
        time.sleep(0.25)


def bundle_manifest(version: Version | None) -> Manifest | None:
    if version is None:
        return None
    return parse_manifest((version.path / "manifest.json").read_bytes())


class OfflineActivator:
    """No appliance runs: try the bundle in a trial server; the next start serves `current`."""

    def __init__(self, trial: TrialRunner) -> None:
        self._trial = trial

    def trial(self, models_dir: Path, manifest: Manifest, report: Report) -> None:
        self._trial(models_dir, manifest, report)

    def switch(self, old: Version | None, new: Version | None, report: Report) -> None:
        return None


class LiveActivator:
    """The running appliance: trial beside it (or in place when two copies do not fit in memory), then
    the running server reloads the bundle's models through its repository API."""

    def __init__(self, control: ServerControl, trial: TrialRunner, *, load_timeout_s: float = 900.0,
                 window_s: float = 3.0, memory_bytes: int | None = None) -> None:  # fmt: skip
        self.control = control
        # Load and unload answer when done: a model load may take minutes (engine builds).
        self._slow = ServerControl(control.socket_path, load_timeout_s)
        self._trial = trial
        self.load_timeout_s = load_timeout_s
        self.window_s = window_s
        self.in_place = False
        self.downtime_s: float | None = None
        self.memory_bytes = memory_bytes  # None: measure

    def trial(self, models_dir: Path, manifest: Manifest, report: Report) -> None:
        need = trial_memory_bytes(models_dir)
        free = self.memory_bytes if self.memory_bytes is not None else available_memory()
        self.in_place = free is not None and need > free
        if self.in_place:
            message = f"two copies do not fit ({need >> 20} MB needed, {(free or 0) >> 20} MB available)"
            report(LOADING, None, message + ": drain, unload, load in place")
            return
        self._trial(models_dir, manifest, report)

    def switch(self, old: Version | None, new: Version | None, report: Report) -> None:
        old_names = set(bundle_manifest(old).models) if old is not None else set()  # type: ignore[union-attr]
        new_manifest = bundle_manifest(new)
        new_names = set(new_manifest.models) if new_manifest is not None else set()
        started = time.monotonic()
        if self.in_place:
            for name in sorted(old_names):
                self._post(f"/v2/repository/models/{name}/unload")
        for name in sorted(new_names):
            self._post(f"/v2/repository/models/{name}/load")
        for name in sorted(old_names - new_names):
            if not self.in_place:
                self._post(f"/v2/repository/models/{name}/unload")
        wait_serving(self.control, new_names, self.load_timeout_s, LOADING, report)
        if self.in_place:
            self.downtime_s = time.monotonic() - started
            report(LOADING, None, f"models were unavailable for {self.downtime_s:.1f}s (in-place reload)")
        if new_manifest is not None:
            report(TRIAL, None, f"{len(new_manifest.checks)} check(s) on the serving server")
            run_checks(self.control, new_manifest.checks)
            watch(self.control, new_names, self.window_s)

    def _post(self, path: str) -> None:
        try:
            status, body = self._slow.request("POST", path, {})
        except ServerUnreachable as exc:
            raise TrialFailed(f"the server did not answer {path}: {exc}") from None
        if status != 200:
            error = body.get("error") if isinstance(body, dict) else body
            raise TrialFailed(f"{path}: {error}")
