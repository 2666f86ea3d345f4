"""What the fleet agent may do to this device, in the supervisor's terms (the agent's DeviceServices)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from edgeserve import __version__
from edgeserve.config import ConfigError, Settings, load_settings_with_sources
from edgeserve.config_allowlist import only_allowed, refused_keys
from edgeserve.fleet.services import FleetCommandFailed, Report
from edgeserve.fsutil import private_mkdir, write_text_atomic
from edgeserve.ota.errors import BundleRefused, StoreError
from edgeserve.ota.installer import Installer, Outcome
from edgeserve.ota.store import Store
from edgeserve.settings_tools import OVERLAY, load_layered_with_overlay, restart_fields, toml_text
from edgeserve.supervisor.child import ServerProcess
from edgeserve.supervisor.control import ServerControl, ServerUnreachable, ServerView


class Appliance(Protocol):
    """All the fleet agent reaches of the device: the Supervisor (supervisor.py) that starts it."""

    settings: Settings
    state_dir: Path
    config_path: Path | None
    cli_overrides: dict[str, dict[str, Any]]
    store: Store
    control: ServerControl
    child: ServerProcess | None
    view: ServerView | None
    server_ready: bool
    backends: dict[str, str]
    restarts: int
    last_error: str

    def make_installer(self) -> Installer: ...

    def on_install(self, outcome: Outcome) -> None: ...

    def call_in_loop(self, fn: Callable[[], Any], timeout_s: float) -> Any: ...

    def reload(self) -> None: ...

    def restart_gracefully(self, reason: str, with_backoff: bool) -> None: ...


class SupervisorServices:
    def __init__(self, supervisor: Appliance) -> None:
        self.sup = supervisor
        self._stats: dict[str, tuple[float, int, int, int]] = {}  # model -> (t, count, queue_ns, compute_ns)

    # -- bundles ----------------------------------------------------------------------------------
    def install(
        self, url: str, sha256: str | None, report: Report, cancel: threading.Event
    ) -> dict[str, Any]:
        try:
            installer = self.sup.make_installer()  # a fleet download: under the [ota] URL rules
            outcome = installer.install(url, report, sha256=sha256, cancel=cancel, origin="fleet")
        except StoreError as exc:
            raise FleetCommandFailed(str(exc)) from None
        self.sup.on_install(outcome)
        if outcome.ok:
            return outcome.to_dict()
        active = self.sup.store.active()
        if outcome.code == "replay" and active is not None and active.version == outcome.version:
            return {
                **outcome.to_dict(),
                "ok": True,
                "state": "COMMITTED",
                "reason": f"{active.label} already serves",
            }
        raise FleetCommandFailed(outcome.reason)

    def rollback(self, to_version: int, report: Report) -> dict[str, Any]:
        try:
            outcome = self.sup.make_installer().rollback(to_version, report)
        except StoreError as exc:
            raise FleetCommandFailed(str(exc)) from None
        if not outcome.ok:
            raise FleetCommandFailed(outcome.reason)
        return outcome.to_dict()

    def gc(self) -> dict[str, Any]:
        try:
            with self.sup.store.lock():
                removed = self.sup.store.gc(keep_resumable=False)
        except StoreError as exc:
            raise FleetCommandFailed(str(exc)) from None
        return {"removed": removed}

    def revoke_key(self, key_id: str, role: str, cmd_id: str) -> dict[str, Any]:
        """Persisted before the answer; the active bundle keeps serving (health says it is revoked)."""
        try:
            result = self.sup.store.trust.revoke(key_id, role, f"fleet command {cmd_id}")
        except (BundleRefused, OSError) as exc:
            raise FleetCommandFailed(f"revocation not recorded: {exc}") from None
        active = self.sup.store.active()
        return {
            **result,
            "active_signer_revoked": bool(active and self.sup.store.trust.revoked_signer(active.path)),
        }

    # -- models and settings ----------------------------------------------------------------------
    def set_model(self, model: str, active: bool) -> dict[str, Any]:
        """Load/unload now through the server's API, and persist the model list in the overlay."""
        action = "load" if active else "unload"
        slow = ServerControl(self.sup.control.socket_path, self.sup.settings.ota.load_timeout_s)
        try:
            status, body = slow.request("POST", f"/v2/repository/models/{model}/{action}", {})
        except ServerUnreachable as exc:
            raise FleetCommandFailed(f"the server did not answer: {exc}") from None
        if status != 200:
            raise FleetCommandFailed(
                f"{action} {model}: {body.get('error') if isinstance(body, dict) else body}"
            )
        ready = {m.name for m in (self.sup.view.models if self.sup.view else []) if m.state == "READY"}
        wanted = (ready | {model}) if active else (ready - {model})
        self.set_config({"server": {"load_models": sorted(wanted)}})
        return {"model": model, "state": "READY" if active else "UNLOADED"}

    def set_config(self, changes: dict[str, dict[str, Any]]) -> dict[str, Any]:
        """Validate on top of the current overlay, persist it, then reload (live or a restart)."""
        refused = refused_keys(changes)  # the agent refuses these before; never persist one anyway
        if refused:
            raise FleetCommandFailed(f"refused: set_config may not change: {'; '.join(refused)}")
        overlay_path = self.sup.state_dir / OVERLAY
        current: dict[str, dict[str, Any]] = {}
        if overlay_path.is_file():
            if sys.version_info >= (3, 11):
                import tomllib
            else:  # Python 3.10 (JetPack 6): the tomli backport, a dependency there
                import tomli as tomllib

            current = only_allowed(tomllib.loads(overlay_path.read_text()), str(overlay_path))
        merged = {section: dict(values) for section, values in current.items()}
        for section, values in changes.items():
            merged.setdefault(section, {}).update(values)
        text = toml_text(merged)
        candidate = overlay_path.with_name(".settings.candidate.toml")
        private_mkdir(candidate.parent)  # the overlay holds settings: the service user's only
        write_text_atomic(candidate, text)
        try:
            # The values themselves first (no environment or flags that could hide a bad one) ...
            load_settings_with_sources(self.sup.config_path, {}, None, overlay=candidate)
            new, sources = load_layered_with_overlay(self.sup.config_path, self.sup.cli_overrides, candidate)
        except ConfigError as exc:
            raise FleetCommandFailed(f"refused: {exc}".replace(str(candidate), "set_config")) from None
        finally:
            candidate.unlink(missing_ok=True)
        # ... then what would not take effect: set by the environment or a command-line flag.
        mine = str(candidate)
        shadowed = [
            f"{section}.{key} (set by {sources[f'{section}.{key}']})"
            for section, values in changes.items()
            for key in values
            if sources.get(f"{section}.{key}", mine) != mine
        ]
        if shadowed:
            raise FleetCommandFailed(f"refused: would not take effect: {', '.join(shadowed)}")
        restart = restart_fields(self.sup.settings, new)
        write_text_atomic(overlay_path, text)
        self.sup.call_in_loop(self.sup.reload, timeout_s=60)
        return {"persisted": str(overlay_path), "restarted_for": restart}

    def restart_runtime(self) -> dict[str, Any]:
        pid = self.sup.child.pid if self.sup.child else None
        self.sup.call_in_loop(
            lambda: self.sup.restart_gracefully("restart_runtime from the fleet", False), 120
        )
        deadline = time.monotonic() + self.sup.settings.ota.load_timeout_s
        while time.monotonic() < deadline:
            child = self.sup.child
            if child is not None and child.pid != pid and self.sup.server_ready:
                return {"old_pid": pid, "new_pid": child.pid}
            time.sleep(0.2)
        raise FleetCommandFailed("the server did not come back ready in time")

    # -- what the fleet sees ----------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        store = self.sup.store.status()
        models = {m.name: m.state for m in (self.sup.view.models if self.sup.view else [])}
        return {
            "active_version": store["active_version"],
            "previous_version": store["previous_version"],
            "bundle": store["active_name"],
            "install_state": store["state"],
            "models": models,
            "backends": dict(self.sup.backends),
            "server_ready": self.sup.server_ready,
            "restarts": self.sup.restarts,
            "last_error": self.sup.last_error,
        }

    def info(self) -> dict[str, Any]:
        plan_path = self.sup.state_dir / "runtime-plan.json"
        hardware: dict[str, Any] = {}
        try:
            import json

            plan = json.loads(plan_path.read_text())
            cpu = plan["hardware"]["cpu"]
            hardware = {
                "arch": cpu.get("arch"),
                "cpu": cpu.get("model_name"),
                "cpus": cpu.get("online_cpus"),
                "memory_bytes": plan["hardware"]["memory"].get("total_bytes"),
                "profile": plan["profile"]["name"],
            }
        except (OSError, ValueError, KeyError, TypeError):
            pass
        active = self.sup.store.active()
        return {
            "hardware": hardware,
            "backends": dict(self.sup.backends),
            "trust": self.sup.store.trust.describe(active.path if active else None),
            "edgeserve": __version__,
            "bundle": {
                k: v
                for k, v in self.status().items()
                if k in ("bundle", "active_version", "previous_version")
            },
        }

    def health(self) -> dict[str, Any]:
        checks: list[str] = []
        view = self.sup.view
        if self.sup.child is None or view is None:
            checks.append("server not answering")
        else:
            checks += [
                f"{m.name} {m.state.lower() or 'not loaded'}"
                for m in view.models
                if m.state not in ("READY", "")
            ]
        if self.sup.last_error:
            checks.append(f"last error: {self.sup.last_error}")
        active = self.sup.store.active()
        revoked = self.sup.store.trust.revoked_signer(active.path) if active else None
        if active is not None and revoked is not None:
            checks.append(
                f"{active.label} is signed by revoked key {revoked}: deploy a bundle signed by a trusted key"
            )
        status = "failing" if not self.sup.server_ready else ("degraded" if checks else "ok")
        return {"status": status, "checks": checks}

    def metrics(self) -> dict[str, Any]:
        import psutil

        memory = psutil.virtual_memory()
        out: dict[str, Any] = {
            "cpu_percent": psutil.cpu_percent(interval=None),
            "memory_percent": memory.percent,
            "memory_available_bytes": memory.available,
        }
        out["temperature_c"] = _temperature()
        child = self.sup.child
        if child is not None:
            out["server_rss_mb"] = child.rss_mb()
        out["models"] = self._model_rates()
        return out

    def _model_rates(self) -> dict[str, Any]:
        try:
            status, body = self.sup.control.request("GET", "/v2/models/stats")
        except ServerUnreachable:
            return {}
        if status != 200 or not isinstance(body, dict):
            return {}
        rates: dict[str, Any] = {}
        now = time.monotonic()
        for entry in body.get("model_stats", []):
            name = str(entry.get("name"))
            stats = entry.get("inference_stats", {})
            count = int(entry.get("inference_count", 0))
            queue_ns = int(stats.get("queue", {}).get("ns", 0))
            compute_ns = int(stats.get("compute_infer", {}).get("ns", 0))
            before = self._stats.get(name)
            self._stats[name] = (now, count, queue_ns, compute_ns)
            if before is None or count < before[1]:
                continue
            done = count - before[1]
            rates[name] = {
                "requests_per_s": round(done / max(now - before[0], 1e-3), 2),
                "queue_ms": round((queue_ns - before[2]) / max(done, 1) / 1e6, 3),
                "compute_ms": round((compute_ns - before[3]) / max(done, 1) / 1e6, 3),
            }
        return rates


def _temperature() -> float | None:
    """The hottest readable thermal zone (SoC boards expose them; VMs often do not)."""
    hottest: float | None = None
    for zone in Path("/sys/class/thermal").glob("thermal_zone*/temp"):
        try:
            value = int(zone.read_text().strip()) / 1000
        except (OSError, ValueError):
            continue
        hottest = value if hottest is None else max(hottest, value)
    return hottest
