"""`[server] event_loop`: uvloop by default where it is installed, asyncio's own loop on request. On
either, a real server answers every frontend the same (tritonclient HTTP, gRPC unary and streaming,
edgeserve's ZeroMQ client), re-reads its settings on SIGHUP and drains on SIGTERM, which both come
through the chosen loop's signal handlers."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import numpy as np
import pytest
from es_server import start_server, wait_until
from onnx_models import write_model
from test_loop_inline_e2e import CONFIG, drive_every_frontend

from edgeserve.client import ZmqClient
from edgeserve.server import eventloop


def test_auto_takes_uvloop_when_installed_and_asyncio_is_honoured() -> None:
    assert eventloop.chosen_loop("auto") == "uvloop"  # a base dependency on Linux
    assert eventloop.chosen_loop("uvloop") == "uvloop"
    assert eventloop.chosen_loop("asyncio") == "asyncio"


def test_without_uvloop_auto_falls_back_and_uvloop_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: the import fails
    assert eventloop.chosen_loop("auto") == "asyncio"
    with pytest.raises(eventloop.EventLoopError, match=r"server\.event_loop.*pip install uvloop"):
        eventloop.chosen_loop("uvloop")


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_every_frontend_and_signal_works_on_either_loop(tmp_path: Path, loop: str) -> None:
    repo = tmp_path / "models"
    write_model(repo, "ident", "identity", datatype="FP32", config=CONFIG)
    server = start_server(repo, tmp_path, env={"EDGESERVE_SERVER_EVENT_LOOP": loop})
    try:
        assert f"event loop: {loop}" in server.log()
        drive_every_frontend(server)
        x = np.arange(16, dtype=np.float32).reshape(1, 16)
        with ZmqClient(server.zmq_endpoint, timeout=10) as client:
            np.testing.assert_array_equal(client.infer("ident", {"INPUT0": x}).as_numpy("OUTPUT0"), x)
        server.process.send_signal(signal.SIGHUP)
        assert wait_until(lambda: "reload: nothing to apply live" in server.log(), 20), server.log()
        drive_every_frontend(server)  # still serving after the reload
    finally:
        code = server.stop()
    assert code == 0, server.log()
    assert "shutdown complete" in server.log()
