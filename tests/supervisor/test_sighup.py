"""SIGHUP: live changes without dropping a request, restart only when a change needs it; bad settings
refused with the field named; the RSS watch restarts a server that grew past max_rss_mb."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient
from appliance import Appliance, ApplianceFactory, wait_until
from onnx_models import write_model
from tritonclient.utils import InferenceServerException


def _logging(app: Appliance) -> dict[str, object]:
    with urllib.request.urlopen(app.base + "/v2/logging", timeout=5) as response:
        return dict(json.loads(response.read()))


class _Load:
    """HTTP inference in a loop on its own thread, counting every outcome."""

    def __init__(self, app: Appliance) -> None:
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._client = httpclient.InferenceServerClient(f"127.0.0.1:{app.http_port}")
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        inp = httpclient.InferInput("INPUT0", [1, 16], "FP32")
        inp.set_data_from_numpy(np.ones((1, 16), np.float32))
        while not self._stop.is_set():
            try:
                self._client.infer("mlp", [inp])
                self.ok += 1
            except (InferenceServerException, OSError) as exc:
                self.errors.append(str(exc))
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self._client.close()


LOAD_REQUESTS = 25


def test_sighup_applies_a_new_log_level_without_dropping_a_request(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    app = appliance_factory(mlp_repo, config='[logging]\nlevel = "INFO"\n')
    app.notify.wait_for("READY", timeout=60)
    server = app.server_pid()
    assert _logging(app)["log_verbose_level"] == 0
    load = _Load(app)
    # Requests are counted, not timed: LOAD_REQUESTS answered before the reload and as many after it
    # (generous deadlines: a busy box answers slowly, never wrongly).
    try:
        wait_until(lambda: load.ok >= LOAD_REQUESTS, 60, "requests before the reload")
        app.config_path.write_text('[logging]\nlevel = "DEBUG"\n')
        sent = time.monotonic()
        app.signal(signal.SIGHUP)
        wait_until(lambda: _logging(app)["log_verbose_level"] == 1, 60, "the server at DEBUG")
        applied = load.ok
        wait_until(lambda: load.ok >= applied + LOAD_REQUESTS, 60, "requests after the reload")
    finally:
        load.stop()
    assert load.errors == []
    assert app.server_pid() == server  # applied live, no restart
    reloading = app.notify.wait_for("RELOADING", "1", timeout=60, since=sent)
    assert "MONOTONIC_USEC" in reloading.fields
    assert app.notify.wait_for("READY", "1", timeout=60, since=reloading.at)
    assert "reload: applying live: logging.level" in app.log()


def test_sighup_loads_and_unloads_models_from_the_list(
    mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    write_model(mlp_repo, "second", "mlp")
    app = appliance_factory(mlp_repo, config='[server]\nload_models = ["mlp"]\n')
    app.notify.wait_for("READY", timeout=60)
    server = app.server_pid()
    assert app.get("/v2/models/second/ready") == 400
    app.config_path.write_text('[server]\nload_models = ["second"]\n')
    app.signal(signal.SIGHUP)
    wait_until(lambda: app.get("/v2/models/second/ready") == 200, 30, "second loaded")
    wait_until(lambda: app.get("/v2/models/mlp/ready") == 400, 30, "mlp unloaded")
    assert app.server_pid() == server


def test_sighup_restarts_the_server_for_a_change_it_cannot_apply_live(app: Appliance) -> None:
    server = app.server_pid()
    # race_max_batch_size = 0: the batch size is not raced (a raced knee would serve with 8 as its
    # floor only, e.g. 16, and hide whether the change reached the new server)
    app.config_path.write_text("[runtime]\ndefault_max_batch_size = 8\nrace_max_batch_size = 0\n")
    app.signal(signal.SIGHUP)
    replacement = app.server_pid(not_pid=server, timeout=30)
    assert replacement != server
    app.wait_ready(60)
    with urllib.request.urlopen(app.base + "/v2/models/mlp/config", timeout=5) as response:
        assert json.loads(response.read())["max_batch_size"] == 8
    assert "the server restarts for runtime.default_max_batch_size" in app.log(), app.log()


def test_bad_settings_on_reload_are_refused_and_the_server_keeps_serving(app: Appliance) -> None:
    server = app.server_pid()
    app.config_path.write_text("[supervisor]\nmax_rss_mb = -5\n")
    sent = time.monotonic()
    app.signal(signal.SIGHUP)
    wait_until(lambda: "reload refused" in app.log(), 10, "the refusal in the log")
    assert "supervisor.max_rss_mb: must be 0 (off) or a size in MB" in app.log()
    wait_until(lambda: any("reload refused" in s for s in app.notify.statuses(since=sent)), 10, "STATUS")
    assert app.server_pid() == server and app.get("/v2/health/ready") == 200


def test_rss_above_the_limit_restarts_the_server_gracefully(app: Appliance) -> None:
    server = app.server_pid()
    app.config_path.write_text(
        "[supervisor]\nmax_rss_mb = 1\nhealth_interval_s = 0.2\nrestart_initial_s = 30\n"
    )
    app.signal(signal.SIGHUP)
    wait_until(lambda: "server RSS" in app.log(), 20, "the RSS restart")
    assert "> max_rss_mb 1" in app.log()
    wait_until(lambda: any("max_rss_mb 1" in s for s in app.notify.statuses()), 10, "STATUS with the reason")
    # Graceful: the old server drained and exited by itself (SIGTERM), not SIGKILL.
    assert f"pid {server} did not stop" not in app.log()


def test_config_check_prints_effective_settings_or_names_the_field(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[supervisor]\nmax_rss_mb = 400\n")
    result = subprocess.run([sys.executable, "-m", "edgeserve", "config", "check", "--config", str(good)],
                            capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert f"# {good}: valid" in result.stdout
    assert "max_rss_mb = 400" in result.stdout and "[supervisor]" in result.stdout
    bad = tmp_path / "bad.toml"
    bad.write_text("[supervisor]\nmax_rss_mbb = 400\n")
    result = subprocess.run([sys.executable, "-m", "edgeserve", "config", "check", "--config", str(bad)],
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 2
    assert f"{bad}: supervisor.max_rss_mbb: unknown setting; did you mean 'max_rss_mb'?" in result.stderr
