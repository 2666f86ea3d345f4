"""The supervisor's pure decisions: restart backoff, the STATUS line, what a settings change needs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from edgeserve.config import load_settings, load_settings_with_sources
from edgeserve.settings_tools import (
    changed_fields,
    render_effective,
    resolve_state_dir,
    restart_fields,
)
from edgeserve.supervisor.control import ModelState
from edgeserve.supervisor.report import served_models, status_line
from edgeserve.supervisor.supervisor import Backoff


def test_backoff_doubles_caps_and_resets_after_a_stable_run() -> None:
    backoff = Backoff(initial_s=1.0, max_s=8.0, stable_after_s=60.0)
    assert [backoff.next_delay(uptime_s=0.5) for _ in range(6)] == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert backoff.next_delay(uptime_s=61.0) == 1.0  # it ran long enough: a fresh crash
    assert backoff.next_delay(uptime_s=1.0) == 2.0


def test_status_line_names_backends_waiting_models_restarts_and_error() -> None:
    models = [
        ModelState("mlp", "1", "READY"),
        ModelState("det", "1", "LOADING"),
        ModelState("rec", "1", "UNAVAILABLE", "failed to load: bad file"),
        ModelState("other", "", ""),
    ]
    line = status_line("loading", models, {"mlp": "onnxruntime"}, {"mlp", "det", "rec"}, 2,
                       "server killed by SIGKILL after 3s; restart in 2.0s", "boom")  # fmt: skip
    assert line.startswith("loading · 1/3 models ready (mlp=onnxruntime)")
    assert "det loading" in line and "rec unavailable: failed to load: bad file" in line
    assert "other" not in line  # not a model to load
    assert "2 restarts" in line and "last error: boom" in line and "restart in 2.0s" in line
    assert "\n" not in status_line("x", [], {}, None, 0, "a\nb", "")


def test_served_models_summarise_the_served_configs() -> None:
    config = {"backend": "onnxruntime", "max_batch_size": 4, "instance_group": [{"count": 2}],
              "parameters": {"intra_op_thread_count": {"string_value": "1"}}}  # fmt: skip
    assert served_models({"mlp": config, "gone": None}) == {
        "mlp": {
            "backend": "onnxruntime",
            "max_batch_size": 4,
            "instances": 2,
            "parameters": {"intra_op_thread_count": "1"},
        }
    }


def test_live_and_restart_fields(tmp_path: Path) -> None:
    base = load_settings(environ={})
    path = tmp_path / "s.toml"
    path.write_text(
        '[logging]\nlevel = "DEBUG"\n[server]\nload_models = ["mlp"]\n[supervisor]\nmax_rss_mb = 300\n'
    )
    live = load_settings(path, environ={})
    assert changed_fields(base, live) == ["logging.level", "server.load_models", "supervisor.max_rss_mb"]
    assert restart_fields(base, live) == []
    path.write_text("[http]\nport = 9000\n[zmq]\nspin_us = 0\n[logging]\nlevel = 'ERROR'\n")
    restart = load_settings(path, environ={})
    assert restart_fields(base, restart) == ["http.port", "zmq.spin_us"]


def test_effective_settings_say_where_each_value_came_from(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text("[http]\nport = 9000\n")
    settings, sources = load_settings_with_sources(path, environ={"EDGESERVE_GRPC_PORT": "9001"},
                                                   overrides={"logging": {"level": "DEBUG"}})  # fmt: skip
    text = render_effective(settings, sources)
    lines = {line.split(" = ")[0]: line for line in text.splitlines() if " = " in line}
    assert "port = 9000" in text and f"# {path}" in text
    assert "environment (EDGESERVE_*)" in next(ln for ln in text.splitlines() if ln.startswith("port = 9001"))
    assert lines["level"].endswith("# command line, live on reload")
    assert lines["max_rss_mb"].endswith("# default, live on reload")
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # Python 3.10: the tomli backport
        import tomli as tomllib

    assert tomllib.loads(text)["http"]["port"] == 9000  # the output is itself a valid settings file


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({"STATE_DIRECTORY": "/var/lib/edgeserve-unit"}, "/var/lib/edgeserve-unit"),
        ({"STATE_DIRECTORY": "/a:/b"}, "/a"),
    ],
)
def test_state_dir_from_systemd(environ: dict[str, str], expected: str) -> None:
    settings, sources = load_settings_with_sources(environ={})
    assert str(resolve_state_dir(settings, sources, environ)[0]) == expected


def test_configured_state_dir_wins_over_systemd(tmp_path: Path) -> None:
    settings, sources = load_settings_with_sources(environ={"EDGESERVE_SERVER_STATE_DIR": str(tmp_path)})
    path, why = resolve_state_dir(settings, sources, {"STATE_DIRECTORY": "/var/lib/x"})
    assert path == tmp_path and "environment" in why


def test_unwritable_default_falls_back_to_the_users_state_folder(tmp_path: Path) -> None:
    settings, sources = load_settings_with_sources(environ={})
    (tmp_path / "a-file").write_text("")
    settings.server.state_dir = tmp_path / "a-file" / "edgeserve"  # cannot be created, even by root
    path, why = resolve_state_dir(settings, sources, {"XDG_STATE_HOME": str(tmp_path)})
    assert path == tmp_path / "edgeserve" and "not writable" in why
