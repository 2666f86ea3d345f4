"""EDGESERVE_DIE_WITH_PARENT (set by `edgeserve tune` for the server it starts) ties a server's life to
its parent. A stale or forged value (another process's pid, garbage, terminal escapes, a huge string)
ties it to no other process: the server refuses to start with one escaped line before it listens
on anything, and never keeps running bound to a process that is not its parent."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from es_server import ROOT, free_port

FORGED = {
    "another process": "1" if os.getpid() != 1 else "2",  # the server's parent is this process
    "garbage with escapes": "12\n\x1b[31mFAKE LOG LINE\x1b[0m",
    "huge": "9" * 100_000,
}


@pytest.mark.parametrize("value", list(FORGED.values()), ids=list(FORGED))
def test_a_forged_parent_pid_stops_the_server_before_it_listens(tmp_path: Path, value: str) -> None:
    repo = tmp_path / "models"
    repo.mkdir()
    http_port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "EDGESERVE_DIE_WITH_PARENT": value}
    env.pop("CONFIGURATION_DIRECTORY", None)
    command = [sys.executable, "-m", "edgeserve", "serve", "--model-repository", str(repo),
               "--model-control-mode", "explicit", "--host", "127.0.0.1",
               "--http-port", str(http_port), "--grpc-port", str(free_port()),
               "--zmq-endpoint", f"ipc://{tmp_path}/es.zmq",
               "--state-dir", str(tmp_path / "state")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path)
    assert done.returncode != 0, f"the server ran with a forged parent pid:\n{done.stderr[-2000:]}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr[-2000:]
    assert lines[0].startswith("edgeserve serve: its parent is gone (EDGESERVE_DIE_WITH_PARENT names ")
    assert f"the parent is pid {os.getpid()}" in lines[0]
    assert "\x1b" not in done.stderr and "FAKE LOG LINE\n" not in done.stderr
    assert len(lines[0]) < 300  # the huge value is cut, not echoed
    assert "listening" not in done.stderr and "Traceback" not in done.stderr
