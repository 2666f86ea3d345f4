"""Bounded logs: with `[logging] file` the supervisor writes its own and the server's lines to one
rotated file (the server's lines pass through it); without, one line per event on stderr."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from appliance import ApplianceFactory, wait_until


def test_log_file_rotates_and_holds_both_processes_lines(
    tmp_path: Path, mlp_repo: Path, appliance_factory: ApplianceFactory
) -> None:
    log_file = tmp_path / "logs" / "edgeserve.log"
    app = appliance_factory(
        mlp_repo, config=f'[logging]\nlevel = "DEBUG"\nfile = "{log_file}"\nmax_bytes = 4096\nbackups = 2\n'
    )
    app.notify.wait_for("READY", timeout=60)
    base = f'[logging]\nfile = "{log_file}"\nmax_bytes = 4096\nbackups = 2\n'
    for i in range(60):  # each reload logs a few lines in both processes
        app.config_path.write_text(base + ('level = "INFO"\n' if i % 2 else 'level = "DEBUG"\n'))
        sent = time.monotonic()
        app.signal(signal.SIGHUP)
        # One reload at a time, each waited for (signals sent faster than a busy box handles them
        # would merge, and fewer reloads log fewer lines than the rotations need).
        reloading = app.notify.wait_for("RELOADING", "1", timeout=60, since=sent)
        app.notify.wait_for("READY", "1", timeout=60, since=reloading.at)
    wait_until(lambda: (tmp_path / "logs" / "edgeserve.log.2").exists(), 60, "two rotations")
    files = sorted((tmp_path / "logs").iterdir())
    assert [f.name for f in files] == ["edgeserve.log", "edgeserve.log.1", "edgeserve.log.2"]
    assert all(f.stat().st_size <= 4096 + 1024 for f in files)  # one line may cross the limit
    text = "".join(f.read_text() for f in files)
    assert "edgeserve.supervisor:" in text and "edgeserve.server:" in text
    assert all(line.count(" edgeserve.") <= 1 for line in text.splitlines())  # one event per line
    assert "edgeserve.repository" not in app.log()  # the server's lines went to the file, not stderr
