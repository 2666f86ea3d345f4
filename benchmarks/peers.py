"""What bench_peers.py's peers share: a throwaway venv per peer (created on first use, pip's progress
shown), a server process started in its own process group (so that stopping it stops exactly what it
started, and nothing else), and the ONNX Runtime session options edgeserve's instance runs with, so
that a peer's own `ort.InferenceSession` is built the same way.

Venvs live under ~/.cache/edgeserve-bench/ (`--venv-dir`); each peer pins what it needs there, apart
from edgeserve's .venv (MLServer's pydantic, Ray's dependencies, PyTriton's numpy < 2).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from common import ROOT, InProcess, Workload, progress, read_config

VENV_DIR = Path.home() / ".cache" / "edgeserve-bench"
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)


def runtime_pin(name: str) -> str:
    """`name==<the version edgeserve's venv runs>`, so a peer runs the same runtime build."""
    return f"{name}=={importlib.metadata.version(name)}"


def ensure_venv(
    venv: Path,
    packages: list[str],
    check: str,
    install: bool,
    system_site: bool = False,
    timeout: float = 1500.0,
) -> tuple[str | None, str]:
    """(python of `venv` where `python -c check` works, or None; why not). Creates the venv and pip
    installs `packages` into it when `check` fails and `install` is true, printing pip's progress."""
    python = venv / "bin" / "python"
    probe = [str(python), "-c", check]

    def works() -> bool:
        with contextlib.suppress(subprocess.SubprocessError, OSError):
            return subprocess.run(probe, capture_output=True, timeout=180).returncode == 0
        return False

    if python.exists() and works():
        return str(python), ""
    if not install:
        return None, f"no working venv at {venv} (`{check}` fails) and installing is off"
    progress(f"installing {' '.join(packages)} into a throwaway venv at {venv} (once) ...")
    try:
        venv.parent.mkdir(parents=True, exist_ok=True)
        cmd = [BASE_PYTHON, "-m", "venv", *(["--system-site-packages"] if system_site else []), str(venv)]
        subprocess.run(cmd, check=True, capture_output=True, timeout=300)
        pip = subprocess.Popen(
            [str(python), "-m", "pip", "install", "--progress-bar", "off", *packages],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline, tail = time.monotonic() + timeout, []
        assert pip.stdout is not None
        for line in pip.stdout:  # "Collecting x", "Downloading y (12 MB)", "Installing collected ..."
            tail = [*tail, line.rstrip()][-20:]
            if line.startswith(("Collecting", "Downloading", "Installing", "Successfully")):
                progress(f"  pip: {line.strip()[:140]}")
            if time.monotonic() > deadline:
                pip.kill()
                return None, f"pip install {' '.join(packages)} took over {timeout:.0f}s"
        if pip.wait(60) != 0:
            return None, f"pip install {' '.join(packages)} failed: {' | '.join(tail[-3:])[-400:]}"
    except (subprocess.SubprocessError, OSError) as exc:
        return None, f"creating {venv} failed: {exc}"
    if not works():
        err = subprocess.run(probe, capture_output=True, text=True, timeout=180).stderr.strip()
        return None, f"installed, but `{check}` fails in {venv}: {err[-300:]}"
    return str(python), ""


# -- a server process in a process group of its own ----------------------------------------------------
def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class PeerProcess:
    """A peer server started here with start_new_session=True: its process group is the one we
    created, and stop() signals that group (and any descendant seen while it ran), nothing else."""

    def __init__(
        self,
        name: str,
        cmd: list[str] | None = None,
        env: dict[str, str] | None = None,
        adopt: tuple[subprocess.Popen[bytes], Path] | None = None,
    ) -> None:
        """Start `cmd` in a new session, or adopt (process, log) that was started so elsewhere."""
        self.name = name
        self.ready_urls: list[str] = []
        if adopt is not None:
            self.process, self.log_path = adopt
        else:
            assert cmd is not None
            workdir = Path(tempfile.mkdtemp(prefix=f"bench-{name}-"))
            self.log_path = workdir / f"{name}.log"
            with open(self.log_path, "wb") as log:
                self.process = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env={**os.environ, **(env or {})},
                    start_new_session=True,
                )
        self.pgid = self.process.pid  # start_new_session: the group's id is the leader's pid
        with contextlib.suppress(ProcessLookupError):
            if os.getpgid(self.process.pid) != self.pgid:
                raise RuntimeError(f"{name}: not started in a process group of its own")
        self.seen: dict[int, float] = {}  # descendants seen (pid -> create_time), to stop leftovers

    @property
    def pid(self) -> int:
        return self.process.pid

    def tree(self) -> list[psutil.Process]:
        """The process and its descendants now (remembered for stop())."""
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return []
        for p in procs[1:]:
            with contextlib.suppress(psutil.Error):
                self.seen[p.pid] = p.create_time()
        return procs

    def wait_ready(self, timeout: float, marker: Path | None = None) -> None:
        """Until every ready URL answers 200 (and `marker` exists, when given)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}: {self.log_tail()}")
            self.tree()
            if (marker is None or marker.exists()) and all(http_ok(url) for url in self.ready_urls):
                return
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready within {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self, lines: int = 6) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace").strip().splitlines()
            return " | ".join(text[-lines:])[-600:] + f" (log: {self.log_path})"
        return f"(log: {self.log_path})"

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the process we started (it shuts its own children down: PyTriton frees its
        shared memory, Ray stops its services), SIGKILL to our group if it has not exited after
        `timeout` (while its leader lives the group is surely ours); then, after 15 s more, SIGKILL to
        every descendant seen that still runs (same pid and start time: the process we saw, not a
        reused pid), in this group or in one it made."""
        self.tree()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(self.pgid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(10)
        mine = []
        for pid, created in self.seen.items():
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                if proc.create_time() == created:
                    mine.append(proc)
        _, alive = psutil.wait_procs(mine, timeout=15)  # children still shutting down after their parent
        for proc in alive:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        if alive:
            progress(f"{self.name}: killed {len(alive)} leftover process(es) it had started")


# -- the session options edgeserve's ONNX Runtime instance uses -----------------------------------------
def ort_spec(config_path: Path, work: Workload, inproc: InProcess) -> dict[str, Any]:
    """What a peer needs to serve `work.model` as edgeserve does: the model file, the batching of
    the config edgeserve serves it with (`config_path`, common.served_config), the instance count,
    and the ORT session options of edgeserve's instance (the same function builds them; the thread
    count is the one the instance runs with)."""
    from edgeserve.backends.onnxruntime import session_options

    if inproc.backend != "onnxruntime":
        raise SystemExit(f"{work.model}: the peers run ONNX Runtime, edgeserve chose {inproc.backend}")
    config = read_config(config_path)
    batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
    so = session_options(inproc.options)
    threads = int(getattr(inproc.instances[0], "threads", 0) or so.intra_op_num_threads)
    entries = {
        key: so.get_session_config_entry(key)
        for key in ("session.intra_op.allow_spinning", "session.inter_op.allow_spinning")
    }
    return {
        "model": work.model,
        "input": work.input_name,
        "output": work.output_name,
        "shape": list(work.shape),
        "model_path": str(inproc.instances[0].path),
        "max_batch_size": int(config.max_batch_size),
        "max_queue_delay_us": int(batching.max_queue_delay_microseconds) if batching else 0,
        "preferred_batch_size": [int(b) for b in batching.preferred_batch_size] if batching else [],
        "instances": len(inproc.instances),
        "ort": {
            "intra_op_num_threads": threads,
            "inter_op_num_threads": int(so.inter_op_num_threads),
            "sequential": True,
            "graph_optimization_level": "ORT_ENABLE_ALL",
            "enable_cpu_mem_arena": bool(so.enable_cpu_mem_arena),
            "enable_mem_pattern": bool(so.enable_mem_pattern),
            "config_entries": entries,
        },
    }


def describe(spec: dict[str, Any]) -> str:
    if spec["max_batch_size"] > 0:
        preferred = ",".join(map(str, spec["preferred_batch_size"])) or "-"
        batching = (
            f"batch <= {spec['max_batch_size']} (preferred {preferred}), wait {spec['max_queue_delay_us']} us"
        )
    else:
        batching = "no batching"
    threads = spec["ort"]["intra_op_num_threads"] or "default"
    return f"{spec['model']}: {batching}, {spec['instances']} ORT session(s) x {threads} thread(s)"


def write_specs(specs: list[dict[str, Any]], workdir: Path) -> Path:
    path = workdir / "spec.json"
    path.write_text(json.dumps(specs, indent=1))
    return path
