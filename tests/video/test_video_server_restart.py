"""The appliance's server dies under a running watch (SIGKILL: what the supervisor restarts) and a new
one comes up on the same endpoint: the watch keeps decoding, counts the frames it could not send,
registers its rings again with the new server and goes on with results, in order, without a restart
of its own."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from es_server import (
    ROOT,
    SIDE_BY_SIDE_ENV,
    RunningServer,
    get_status,
    server_command,
    start_server,
    wait_until,
)
from video_clips import quick_sources

from edgeserve.video import Result, Watch, WatchOptions, parse_sources

MODELS = ROOT / "models"  # not imported from conftest: another folder's conftest may hold that name


def _again(old: RunningServer, tmp: Path) -> subprocess.Popen[bytes]:
    """A new server on the old one's ports and ZeroMQ endpoint, ready."""
    command = server_command(
        "serve", MODELS, old.http_port, old.grpc_port, old.zmq_endpoint, ["--load-model", "centerface"]
    )
    with open(tmp / "again.log", "wb") as log:
        env = {**os.environ, **SIDE_BY_SIDE_ENV}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
    assert wait_until(lambda: get_status(old.base + "/v2/health/ready") == 200, 120), (
        tmp / "again.log"
    ).read_text()
    return process


def test_the_watch_goes_on_after_the_server_is_killed_and_comes_back(clips, tmp_path: Path) -> None:
    if not (MODELS / "centerface" / "1" / "model.onnx").exists():
        pytest.skip("sample models missing: run `edgeserve samples`")
    server = start_server(MODELS, tmp_path, args=["--load-model", "centerface"], timeout=300)
    again: subprocess.Popen[bytes] | None = None
    results: list[Result] = []
    source = dataclasses.replace(quick_sources(), realtime=True, loop=True)
    options = WatchOptions(model="centerface", endpoint=server.zmq_endpoint, timeout=3.0, source=source)
    watch = Watch(parse_sources([f"cam={clips['h264']}"]), options, on_result=results.append)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    try:
        assert wait_until(lambda: len(results) >= 5, 60), "no results before the kill"
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(10)
        before = len(results)
        stream = watch.streams[0]
        # frames decoded meanwhile have nowhere to go: waited for, not slept on (a busy box decodes slowly)
        assert wait_until(lambda: stream.stats.failed + stream.stats.rejected > 0, 60), "none lost meanwhile"
        again = _again(server, tmp_path)
        assert wait_until(lambda: len(results) >= before + 10, 60), "no results after the restart"
        assert stream.thread.counters.decoded > len(results)  # decoding never stopped
        assert stream.stats.failed + stream.stats.rejected > 0  # the lost frames are counted
        indexes = [r.frame for r in results]
        assert indexes == sorted(indexes)  # still in frame order
        assert thread.is_alive()
    finally:
        watch.stop()
        thread.join(60)
        if again is not None:
            again.send_signal(signal.SIGTERM)
            again.wait(30)
        server.stop()
    assert not thread.is_alive()
