"""The supervisor's bundle duties: recovery at start, installers for the bundle socket and the fleet
agent, and going back to the previous bundle when a new one keeps crashing the server."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from edgeserve.config import Settings
from edgeserve.logs import forward_line
from edgeserve.ota.errors import StoreError
from edgeserve.ota.installer import Installer, damage
from edgeserve.ota.policy import Policy
from edgeserve.ota.store import Store
from edgeserve.ota.trust import TrustStore, trust_dir_for
from edgeserve.ota.url_policy import UrlPolicy
from edgeserve.supervisor.control import ServerControl
from edgeserve.supervisor.report import device_accelerators

log = logging.getLogger("edgeserve.supervisor")

CRASH_WINDOW_S = 600.0  # crashes this soon after a bundle switch count against the bundle


class BundleKeeper:
    def __init__(self, store: Store, control: ServerControl) -> None:
        self.store = store
        self.control = control
        self.committed_at: float | None = None  # monotonic time of the last switch
        self.crashes = 0

    def recover(self) -> str | None:
        """Undo an install a crash or power cut interrupted; what was done, for the status line."""
        from edgeserve.ota.installer import recover

        try:
            with self.store.lock():
                done = recover(self.store)
        except (StoreError, OSError) as exc:
            log.error("bundle store %s: %s", self.store.root, exc)
            return None
        history = self.store.journal()["history"]
        last = next((h for h in reversed(history) if h.get("state") == "COMMITTED"), None)
        age = time.time() - float(last.get("finished_at", 0)) if last else None
        if age is not None and age < CRASH_WINDOW_S:  # a switch just before a restart or power cut counts
            self.committed_at = time.monotonic() - age
        return f"bundle install {done}" if done else None

    def make_installer(self, settings: Settings, config_path: Path | None) -> Installer:
        from edgeserve.repository.layout import list_models
        from edgeserve.supervisor.activate import LiveActivator, TrialRunner

        repository = settings.server.model_repository
        ota = settings.ota
        # [ota] trust_dir is live: each install reads the folder the settings name now
        self.store.trust = TrustStore(trust_dir_for(settings, self.store.state_dir), self.store.state_dir)

        def trial_log(line: str) -> None:
            forward_line(f"[trial] {line}")

        def repository_models() -> set[str]:
            return set(list_models(repository)) if repository.is_dir() else set()

        trial = TrialRunner(self.store.state_dir, config_path, load_timeout_s=ota.load_timeout_s,
                            window_s=ota.trial_window_s, log_line=trial_log)  # fmt: skip
        activator = LiveActivator(self.control, trial, load_timeout_s=ota.load_timeout_s,
                                  window_s=min(ota.trial_window_s, 5.0),
                                  memory_bytes=ota.trial_memory_mb * 2**20 or None)  # fmt: skip
        policy = Policy(max_unpacked_bytes=ota.max_unpacked_mb * 2**20)
        urls = UrlPolicy(ota.allow_file_urls, ota.allow_loopback_urls, ota.allow_link_local_urls)
        return Installer(self.store, activator, policy=policy, accelerators=device_accelerators(settings),
                         other_models=repository_models, url_policy=urls)  # fmt: skip

    def committed(self) -> None:
        self.committed_at = time.monotonic()
        self.crashes = 0

    def crashed(self, limit: int) -> str | None:
        """Count a server crash; past `limit` soon after a switch, roll back and say why."""
        if self.committed_at is None or time.monotonic() - self.committed_at > CRASH_WINDOW_S:
            return None
        self.crashes += 1
        previous, active = self.store.previous(), self.store.active()
        if not limit or self.crashes < limit or previous is None:
            return None
        revoked = self.store.trust.revoked_signer(previous.path)
        if revoked is not None:  # the fleet revoked its signer: crashing beats running what it signed
            log.error("%s is signed by revoked key %s: no crash-loop rollback to it", previous.label, revoked)
            return None
        damaged = damage(previous)
        if damaged is not None:  # a changed file would run instead of the signed one
            log.error("%s: no crash-loop rollback to it", damaged)
            return None
        reason = f"the server crashed {self.crashes} times after {active.label if active else '-'}"
        try:
            with self.store.lock():
                self.store.point(self.store.current_link, previous)
                self.store.point(self.store.previous_link, active)
                self.store.record_event("ROLLED_BACK", f"{reason}: rolled back to {previous.label}",
                                        name=previous.name, version=previous.version)  # fmt: skip
        except StoreError as exc:
            log.error("crash-loop rollback not possible now: %s", exc)
            return None
        self.committed_at = None
        log.error("%s; rolled back to %s", reason, previous.label)
        return f"{reason}; rolled back to {previous.label}"
