"""The server `edgeserve tune` starts: it dies with `tune` (even when `tune` is killed with SIGKILL),
and it starts from a process that uses grpc. A preexec_fn for PDEATHSIG made the fork run grpc's
fork handlers, whose restarted poller thread aborted the child on the fds close_fds had closed
("epoll_wait error: Bad file descriptor", exit -6); the server now sets PDEATHSIG itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
from es_server import ROOT, wait_until
from onnx_models import write_model

# A `tune` stand-in: starts the tune server after grpc's poller has run in this process, prints the
# server's pid, then waits to be killed.
PARENT = textwrap.dedent(
    """
    import sys, time
    from concurrent import futures
    from pathlib import Path
    import grpc
    from edgeserve.bench.tune_server import TuneServer

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=10)  # grpc's poller has run in this process
    for attempt in range(5):  # each start forks from this grpc-using process
        tune = TuneServer(Path(sys.argv[1]), "mlp")
        tune.start()
        if attempt < 4:
            tune.stop()
    print(tune.process.pid, flush=True)
    time.sleep(600)
    """
)


def test_the_tune_server_starts_from_a_grpc_process_and_dies_with_a_killed_tune(tmp_path: Path) -> None:
    config = (ROOT / "models" / "mlp" / "config.pbtxt").read_text()
    model_dir = write_model(tmp_path / "samples", "mlp", "mlp", config=config)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(model_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline().decode().strip()
        if not line.isdigit():
            parent.kill()
            _, err = parent.communicate(timeout=30)
            raise AssertionError(f"the stand-in did not start its tune server:\n{err.decode()[-3000:]}")
        server = psutil.Process(int(line))
        assert server.is_running() and server.ppid() == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(30)
        assert wait_until(lambda: _gone(server), 60), "the tune server outlived the killed tune"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
