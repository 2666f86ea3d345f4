"""`edgeserve run`: keep the server child alive and tell systemd the truth about it.

One thread owns every decision (the loop below); signal handlers only queue the signal and wake it.
Never imports numpy, the runtimes or grpc: it must stay small and outlive a crashing server.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from edgeserve import __version__
from edgeserve.config import ConfigError, Settings
from edgeserve.fsutil import harden, protect_process
from edgeserve.logs import forward_line, set_level

if TYPE_CHECKING:
    from edgeserve.fleet.engines import Agent
from edgeserve.ota.installer import Installer, Outcome
from edgeserve.ota.store import Store
from edgeserve.ota.trust import trust_dir_for
from edgeserve.settings_tools import changed_fields, resolve_state_dir, restart_fields
from edgeserve.supervisor.bundles import BundleKeeper
from edgeserve.supervisor.child import ServerProcess, describe_exit
from edgeserve.supervisor.control import ServerControl, ServerUnreachable, ServerView
from edgeserve.supervisor.notify import Notifier
from edgeserve.supervisor.ota_service import OtaService
from edgeserve.supervisor.report import PLAN_FILE, LoopCalls, served_models, status_line, write_plan
from edgeserve.supervisor.waker import Waker

log = logging.getLogger("edgeserve.supervisor")

SettingsLoader = Callable[[], tuple[Settings, dict[str, str]]]
RSS_STRIKES = 3  # consecutive samples over max_rss_mb before a restart: one spike is not a leak
EXTEND_BY_S = 30.0  # each EXTEND_TIMEOUT_USEC buys this long; renewed every health round
STARTING_POLL_S = 0.1  # health poll while the server is not ready yet, to report READY promptly


class Backoff:
    """Exponential restart delay: initial, doubling, capped; reset after a stable run."""

    def __init__(self, initial_s: float, max_s: float, stable_after_s: float) -> None:
        self.initial_s, self.max_s, self.stable_after_s = initial_s, max_s, stable_after_s
        self.failures = 0

    def next_delay(self, uptime_s: float) -> float:
        if uptime_s >= self.stable_after_s:
            self.failures = 0
        self.failures += 1
        return float(min(self.max_s, self.initial_s * 2 ** (self.failures - 1)))


class Supervisor:
    def __init__(
        self,
        load_settings: SettingsLoader,
        serve_args: Sequence[str],
        config_path: Path | None = None,
        cli_overrides: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self._load_settings = load_settings
        self.config_path = config_path
        self.cli_overrides = cli_overrides or {}
        self.settings, sources = load_settings()
        self.state_dir, why = resolve_state_dir(self.settings, sources)
        self._state_dir_why = why
        self.serve_args = list(serve_args)
        self.notifier = Notifier()
        runtime_dir = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        self._own_runtime_dir = not runtime_dir
        self.runtime_dir = Path(runtime_dir or tempfile.mkdtemp(prefix="edgeserve-"))
        self.control = ServerControl(
            self.runtime_dir / "server.sock", self.settings.supervisor.health_timeout_s
        )
        self.backoff = self._new_backoff()
        self.child: ServerProcess | None = None
        self.restarts = 0
        self.next_start_at = 0.0
        self.note = ""  # why the last restart happened, shown in STATUS
        self.last_error = ""
        self.view: ServerView | None = None
        self.backends: dict[str, str] = {}
        self._configs: dict[str, dict[str, Any]] = {}
        self.last_answer_at = 0.0  # monotonic time of the last health answer from this child
        self.ready_sent = False
        self.server_ready = False
        self.plan_written_for: int | None = None
        self._rss_strikes = 0
        self._next_health_at = 0.0
        self._next_watchdog_at = 0.0
        self._last_status = ""
        self._signals: list[int] = []
        self._wake = Waker()
        self.store = Store(self.state_dir, trust_dir_for(self.settings, self.state_dir))
        self.bundles = BundleKeeper(self.store, self.control)
        self.ota: OtaService | None = None
        self.agent: Agent | None = None
        self._calls = LoopCalls(self._wake)

    def _new_backoff(self) -> Backoff:
        sup = self.settings.supervisor
        return Backoff(sup.restart_initial_s, sup.restart_max_s, sup.stable_after_s)

    # -- signals --------------------------------------------------------------------------------------
    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signals.append(signum)
        self._wake.set()

    def _install_signals(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)

    # -- main loop ------------------------------------------------------------------------------------
    def run(self) -> int:
        protect_process()  # umask 077: UMask=0007 is for the ZeroMQ socket only (fsutil)
        self._install_signals()
        started = time.monotonic()
        log.info("supervisor pid %d: state dir %s (%s)", os.getpid(), self.state_dir, self._state_dir_why)
        harden(self.state_dir)
        for removed in self.store.drop_bytecode():
            log.warning("bundle store: removed %s (an earlier release's bytecode)", removed)
        self._write_device_plan()
        recovered = self.bundles.recover()
        if recovered:
            self.last_error = recovered
        self.ota = OtaService(self.store, self.make_installer, self.on_install)
        try:
            self.ota.start()
        except OSError as exc:
            log.error("bundle installs through this appliance are off: %s", exc)
            self.ota = None
        self._start_agent()
        if self.notifier.watchdog_interval_s:
            log.info(
                "systemd watchdog: pinging every %.1fs while the server answers",
                self.notifier.watchdog_interval_s,
            )
        try:
            while True:
                stop = self._handle_signals()
                if stop:
                    return self._shutdown()
                self._calls.run_pending()
                self._step()
                if not self.ready_sent and self.server_ready:
                    self.ready_sent = True
                    self.notifier.send(READY=1, MAINPID=os.getpid(), STATUS=self._status("serving"))
                    log.info("ready in %.2fs: %s", time.monotonic() - started, self._status("serving"))
                self._wake.wait(self._sleep_s())
                self._wake.clear()
        finally:
            self._stop_agent()
            if self.ota is not None:
                self.ota.stop()
            self.notifier.close()
            self._wake.close()
            if self._own_runtime_dir:
                shutil.rmtree(self.runtime_dir, ignore_errors=True)

    def _sleep_s(self) -> float:
        now = time.monotonic()
        deadlines = [self._next_health_at]
        if self.child is None:
            deadlines.append(self.next_start_at)
        if self.notifier.watchdog_interval_s:
            deadlines.append(self._next_watchdog_at)
        return max(0.01, min(min(deadlines) - now, 0.5))

    def _step(self) -> None:
        now = time.monotonic()
        if self.child is None:
            if now >= self.next_start_at:
                self._spawn()
            self._watchdog(now)
            return
        code = self.child.poll()
        if code is not None:
            self._child_died(code)
            return
        if now >= self._next_health_at:
            self._health_round()
            self._check_rss()
            self._check_hang()
        self._watchdog(time.monotonic())

    # -- the child ------------------------------------------------------------------------------------
    def _spawn(self) -> None:
        self.server_ready = False
        self.view = None
        self.backends = {}
        self._configs = {}
        self._rss_strikes = 0
        self.child = ServerProcess(self.serve_args, self.control.socket_path, self.state_dir, forward_line)
        self.last_answer_at = 0.0
        self._next_health_at = time.monotonic() + STARTING_POLL_S
        log.info("server started: pid %d", self.child.pid)
        self._publish_status("starting server")

    def _child_died(self, code: int) -> None:
        assert self.child is not None
        child, self.child = self.child, None
        child.wait_exit()
        # Why it was killed says more than the last ERROR line it printed (a port in use, say).
        self.last_error = child.killed_for or child.last_error or self.last_error
        delay = self.backoff.next_delay(child.uptime_s)
        self.restarts += 1
        self.next_start_at = time.monotonic() + delay
        self.note = f"server {describe_exit(code)} after {child.uptime_s:.0f}s; restart in {delay:.1f}s"
        log.error("server pid %d %s (up %.1fs); restart %d in %.1fs", child.pid, describe_exit(code),
                  child.uptime_s, self.restarts, delay)  # fmt: skip
        self.server_ready = False
        self._publish_status("restarting")
        self._crash_loop_rollback()

    def restart_gracefully(self, reason: str, with_backoff: bool) -> None:
        """Drain and stop the server, then start it again (at once, or after the crash backoff)."""
        if self.child is None:
            return
        child, self.child = self.child, None
        log.warning("restarting the server: %s", reason)
        self.note = reason
        self._publish_status("restarting")
        child.stop(self.settings.server.exit_timeout_s + 5, tick=lambda: self._watchdog(time.monotonic()))
        self.restarts += 1
        delay = self.backoff.next_delay(child.uptime_s) if with_backoff else 0.0
        self.next_start_at = time.monotonic() + delay
        self.server_ready = False

    # -- health ---------------------------------------------------------------------------------------
    def _health_round(self) -> None:
        assert self.child is not None
        interval = self.settings.supervisor.health_interval_s
        try:
            view = self.control.view()
        except ServerUnreachable:
            self._next_health_at = time.monotonic() + (STARTING_POLL_S if not self.server_ready else interval)
            return
        self.last_answer_at = time.monotonic()
        if self.agent is not None and (self.view is None or self.view.models != view.models):
            self.agent.state_changed()
        self.view = view
        expected = self._expected(view)
        ready_names = {m.name for m in view.models if m.state == "READY"}
        now_ready = view.live and (expected <= ready_names if expected is not None else view.ready)
        self._learn_backends(ready_names)
        if now_ready and not self.server_ready:
            self._on_server_ready()
        self.server_ready = now_ready
        if not self.ready_sent and self._loading(view):
            self.notifier.send(EXTEND_TIMEOUT_USEC=int(EXTEND_BY_S * 1e6))
        self._publish_status("serving" if now_ready else "loading")
        self._next_health_at = time.monotonic() + (interval if now_ready else STARTING_POLL_S)

    def _expected(self, view: ServerView) -> set[str] | None:
        server = self.settings.server
        if server.model_control_mode == "none" or "*" in server.load_models:
            return {m.name for m in view.models}
        return set(server.load_models)

    @staticmethod
    def _loading(view: ServerView) -> bool:
        return any(m.state in ("LOADING", "") for m in view.models) or not view.models

    def _learn_backends(self, ready_names: set[str]) -> None:
        """The backend of each newly ready model, from its served config (one request per model)."""
        for name in sorted(ready_names - self.backends.keys()):
            config = self.control.served_config(name)
            if config is not None:
                self.backends[name] = str(config.get("backend") or config.get("platform") or "")
                self._configs[name] = config

    def _on_server_ready(self) -> None:
        assert self.child is not None
        self.note = ""  # "restart in 1.0s" is history once it serves again; the restart count stays
        if self.plan_written_for != self.child.pid:
            self.plan_written_for = self.child.pid
            self._write_device_plan(served_models(self._configs))
        log.info("server pid %d serving: %s", self.child.pid,
                 ", ".join(f"{n} on {b}" for n, b in self.backends.items()) or "no models")  # fmt: skip

    def _check_rss(self) -> None:
        limit = self.settings.supervisor.max_rss_mb
        if not limit or self.child is None:
            return
        rss = self.child.rss_mb()
        if rss is None or rss <= limit:
            self._rss_strikes = 0
            return
        self._rss_strikes += 1
        if self._rss_strikes >= RSS_STRIKES:
            reason = f"server RSS {rss:.0f} MB > max_rss_mb {limit}"
            self.last_error = reason
            self.restart_gracefully(reason, with_backoff=True)

    def _check_hang(self) -> None:
        hang_s = self.settings.supervisor.hang_timeout_s
        if not hang_s or self.child is None:
            return
        silent_since = self.last_answer_at or self.child.started_at
        if time.monotonic() - silent_since > hang_s:
            self.last_error = f"server pid {self.child.pid} did not answer its health check for {hang_s:.0f}s"
            log.error("%s; killing it", self.last_error)
            self.child.kill(self.last_error)

    def _healthy_now(self, now: float) -> bool:
        """Whether a watchdog ping is honest: the server answered within the last interval, or a start
        is under way (not started yet, or started and not silent past hang_timeout_s)."""
        if self.child is None:
            return True
        window = max(self.settings.supervisor.health_interval_s + self.settings.supervisor.health_timeout_s,
                     self.notifier.watchdog_interval_s or 0.0)  # fmt: skip
        if self.last_answer_at:
            return now - self.last_answer_at <= window
        hang_s = self.settings.supervisor.hang_timeout_s or float("inf")
        return now - self.child.started_at <= hang_s

    def _watchdog(self, now: float) -> None:
        interval = self.notifier.watchdog_interval_s
        if not interval or now < self._next_watchdog_at:
            return
        if self._healthy_now(now):
            self.notifier.send(WATCHDOG=1)
            self._next_watchdog_at = now + interval
        else:
            self._next_watchdog_at = now + min(interval, 0.5)  # ping as soon as it answers again

    # -- status ---------------------------------------------------------------------------------------
    def _status(self, phase: str) -> str:
        models = self.view.models if self.view else []
        expected = self._expected(self.view) if self.view else None
        error = self.last_error or (self.child.last_error if self.child else "")
        return status_line(phase, models, self.backends, expected, self.restarts, self.note, error)

    def _publish_status(self, phase: str) -> None:
        text = self._status(phase)
        if text != self._last_status:
            self._last_status = text
            self.notifier.send(STATUS=text)

    def _write_device_plan(self, models: dict[str, object] | None = None) -> None:
        write_plan(self.state_dir / PLAN_FILE, self.settings, models)

    # -- work other threads hand to the loop (the fleet agent: reload, restart) -----------------------
    def call_in_loop(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """Run `fn` on the supervisor's own thread (it owns the child and the settings); its result."""
        return self._calls.call(fn, timeout_s)

    # -- the fleet agent ------------------------------------------------------------------------------
    def _start_agent(self) -> None:
        if not self.settings.fleet.broker:
            return
        from edgeserve.supervisor.fleet_services import SupervisorServices

        services = SupervisorServices(self)
        try:
            from edgeserve.fleet.engines import make_agent

            agent = make_agent(self.settings.fleet, self.state_dir, services, __version__, self.store.trust)
        except ImportError as exc:  # paho-mqtt missing: serve anyway, say why there is no agent
            log.error("fleet agent off: %s (pip install 'edgeserve[fleet]')", exc)
            return
        except ValueError as exc:  # e.g. a host name the fleet's topics cannot carry: serve anyway
            log.error("fleet agent off: %s", exc)
            return
        self.agent = agent
        self.agent.start()

    def _stop_agent(self) -> None:
        if self.agent is not None:
            self.agent.stop()
            self.agent = None

    # -- bundles: the keeper does the work; the loop keeps the status and the restart timing -----------
    def make_installer(self) -> Installer:
        return self.bundles.make_installer(self.settings, self.config_path)

    def on_install(self, outcome: Outcome) -> None:
        if outcome.ok:
            self.bundles.committed()
            self.note = f"bundle {outcome.reason}"
        else:
            self.last_error = f"bundle install {outcome.state}: {outcome.reason}"
        self._wake.set()

    def _crash_loop_rollback(self) -> None:
        reason = self.bundles.crashed(self.settings.ota.crash_rollback_restarts)
        if reason:
            self.last_error = reason
            self.next_start_at = time.monotonic()  # start the old bundle now, no backoff
            self.backoff.failures = 0

    # -- signals: stop and reload ---------------------------------------------------------------------
    def _handle_signals(self) -> bool:
        while self._signals:
            signum = self._signals.pop(0)
            if signum in (signal.SIGTERM, signal.SIGINT):
                return True
            if signum == signal.SIGHUP:
                self.reload()
        return False

    def reload(self) -> None:
        monotonic_usec = int(time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6)
        self.notifier.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec)
        try:
            new, _ = self._load_settings()
        except ConfigError as exc:
            self.last_error = f"reload refused: {exc}"
            log.error("reload refused, keeping the running settings: %s", exc)
            self.notifier.send(READY=1, STATUS=self._status("serving" if self.server_ready else "loading"))
            return
        changed = changed_fields(self.settings, new)
        needs_restart = restart_fields(self.settings, new)
        self.settings = new
        set_level(new.logging.level)
        self.control.timeout_s = new.supervisor.health_timeout_s
        if any(
            name.startswith("supervisor.restart") or name == "supervisor.stable_after_s" for name in changed
        ):
            failures, self.backoff = self.backoff.failures, self._new_backoff()
            self.backoff.failures = failures
        if any(name.startswith("fleet.") for name in changed):
            log.info("reload: fleet settings changed; reconnecting the agent")
            self._stop_agent()
            self._start_agent()
        if not changed:
            log.info("reload: settings unchanged")
        elif needs_restart:
            log.info(
                "reload: %s changed; the server restarts for %s", ", ".join(changed), ", ".join(needs_restart)
            )
            self.restart_gracefully(f"settings changed: {', '.join(needs_restart)}", with_backoff=False)
        else:
            log.info("reload: applying live: %s", ", ".join(changed))
            if self.child is not None:
                self.child.signal(signal.SIGHUP)
        self.notifier.send(READY=1, STATUS=self._status("serving" if self.server_ready else "loading"))

    def _shutdown(self) -> int:
        grace = self.settings.server.exit_timeout_s
        self.notifier.send(STOPPING=1, STATUS=f"stopping: draining requests for up to {grace:.0f}s")
        log.info("stopping: draining the server for up to %.0fs", grace)
        if self.child is not None:
            child, self.child = self.child, None
            code = child.stop(grace + 5, tick=lambda: self._watchdog(time.monotonic()))
            log.info("server pid %d %s", child.pid, describe_exit(code))
        log.info("supervisor stopped")
        return 0
