"""The Ray Serve way of bench_composition.py: the same three steps (pre-process, the same ONNX classifier
through ONNX Runtime with edgeserve's session options, post-process argmax) as three Ray Serve
deployments, composed by an ingress deployment that holds their DeploymentHandles and awaits
`pre.remote(...)`, `classifier.remote(...)`, `post.remote(...)` in turn. The ingress sits behind Ray
Serve's HTTP proxy on 127.0.0.1 at `/pipeline`: the client posts the raw UINT8 image bytes (shape in an
`x-shape` header) and reads the class back as text.

    <ray venv>/bin/python benchmarks/ray_composition.py SPEC.json --port P --ready FILE --temp-dir D

Ray runs from bench_peers' venv (ray_peer.prepare: ray[serve]==2.60.0 and edgeserve's onnxruntime,
built on first use with pip's progress). Ray binds some services to every interface whatever it is
asked, so bench_composition.py runs only inside a new network namespace that has nothing but `lo`
(`in_namespace`; its own processes included). The launcher half of this file runs in edgeserve's venv;
the serving half (`serve_main`) in the Ray venv, importing only ray, numpy, starlette and peer_ort.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

HERE = Path(__file__).resolve().parent
ROUTE = "/pipeline"
READY_S = 900.0  # Ray starts GCS, raylet, workers, controller, proxy, 4 replicas: slow on 2 busy cores
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


# -- the launcher (edgeserve's venv) ----------------------------------------------------------------------
def netns_problem() -> str:
    """'' when a network namespace with only `lo` can be made here, else why not."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        return "Ray binds services to every interface; a network namespace (unshare --net, root) is needed"
    try:
        probe = subprocess.run(["unshare", "--net", "--", "ip", "link", "set", "lo", "up"],
                               capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
    except (subprocess.SubprocessError, OSError) as exc:
        return f"unshare --net failed: {exc}"
    return "" if probe.returncode == 0 else f"unshare --net failed: {probe.stderr.strip()[:200]}"


def in_namespace(script: Path, argv: list[str]) -> int:
    """Run `script argv --in-netns` again in a new network namespace (gone when its last process
    exits: everything started in it is stopped by the script itself); its exit status."""
    cmd = ["unshare", "--net", "--", sys.executable, str(script), *argv, "--in-netns"]
    return subprocess.run(cmd, check=False).returncode


def start(python: str, spec: dict[str, Any], workdir: Path) -> Any:
    """Start the Ray Serve pipeline (not waiting): (PeerProcess, address, ready marker)."""
    from common import free_port
    from peers import PeerProcess, write_specs

    port = free_port()
    marker = workdir / "ready"
    env = {
        "PYTHONPATH": str(HERE),
        "RAY_worker_niceness": "0",  # Ray renices its workers by default; edgeserve is not reniced
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        "RAY_DEDUP_LOGS": "0",
    }
    cmd = [python, str(Path(__file__).resolve()), str(write_specs([spec], workdir)), "--port", str(port),
           "--ready", str(marker), "--temp-dir", str(workdir / "ray")]  # fmt: skip
    process = PeerProcess("ray-composition", cmd, env=env)
    process.ready_urls = [f"http://127.0.0.1:{port}/-/healthz"]
    return process, f"127.0.0.1:{port}", marker


def prepare(venv_dir: Path, install: bool) -> tuple[str | None, str]:
    """(python of bench_peers' Ray venv, or None; why not): built on first use when `install`."""
    import ray_peer

    return ray_peer.prepare(venv_dir, install)


def launch(
    python: str, repository: Path, http_base: str, image: Any
) -> tuple[Caller | str, Callable[[], None]]:
    """(a call returning the class, or why Ray Serve did not start; its stop). The classifier's
    session is built as edgeserve's running instance is (its served config, thread count and ORT
    options: peers.ort_spec)."""
    from common import InProcess, Workload, progress, served_config
    from peers import ort_spec

    workdir = Path(tempfile.mkdtemp(prefix="bench-ray-pipeline-"))
    try:
        inproc = InProcess.matching(repository, "classifier", http_base)
        try:
            work = Workload("classifier", "NORM", "LOGITS", (1, 3, 224, 224), 0)
            spec = ort_spec(served_config(http_base, "classifier", workdir), work, inproc)
        finally:
            inproc.close()
        progress(f"Ray Serve: starting pre -> classifier -> post ({spec['ort']['intra_op_num_threads']} "
                 "ORT thread(s)); minutes on a loaded box")  # fmt: skip
        process, address, marker = start(python, spec, workdir)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise

    def stop(keep_log: bool = False) -> None:
        process.stop()  # SIGTERM, then its group, then every descendant seen, by PID and start time
        shutil.rmtree(workdir, ignore_errors=True)
        if not keep_log:  # PeerProcess's folder for the log
            shutil.rmtree(process.log_path.parent, ignore_errors=True)

    try:
        process.wait_ready(READY_S, marker)
    except BaseException as exc:  # what it started is stopped; the row says why (Ctrl-C goes on up)
        stop(keep_log=True)  # the row names it
        if not isinstance(exc, Exception):
            raise
        return f"Ray Serve did not start (log {process.log_path}): {str(exc)[:300]}", lambda: None
    return Caller(address, image, process.pid), stop


class Caller:
    """POST the image to the ingress, the class back; one keep-alive connection per client thread."""

    def __init__(self, address: str, image: Any, pid: int) -> None:
        self.pid = pid  # the Ray driver: its tree is paused while the other ways run
        self.host, _, port = address.partition(":")
        self.port = int(port)
        self.body = image.tobytes()
        self.headers = {
            "content-type": "application/octet-stream",
            "x-shape": ",".join(map(str, image.shape)),
        }
        self.local = threading.local()

    def __call__(self) -> int:
        conn: http.client.HTTPConnection | None = getattr(self.local, "conn", None)
        if conn is None:
            conn = self.local.conn = http.client.HTTPConnection(self.host, self.port, timeout=120)
        try:
            conn.request("POST", ROUTE, body=self.body, headers=self.headers)
            response = conn.getresponse()
            text = response.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            conn.close()
            self.local.conn = None  # a fresh connection for the next call
            raise
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {text[:160]}")
        return int(text)


# -- inside the Ray venv ----------------------------------------------------------------------------------
def build_app(spec: dict[str, Any]) -> Any:
    import numpy as np
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse

    mean = (np.array(MEAN, np.float32) * 255).reshape(1, 3, 1, 1)
    scale = 1 / (np.array(STD, np.float32) * 255).reshape(1, 3, 1, 1)
    options: dict[str, Any] = {"max_ongoing_requests": 256, "ray_actor_options": {"num_cpus": 0}}

    @serve.deployment(**options)
    class Pre:
        def __call__(self, image: Any) -> Any:
            return np.ascontiguousarray((image.transpose(0, 3, 1, 2).astype(np.float32) - mean) * scale)

    @serve.deployment(**options)
    class Classifier:
        def __init__(self, spec: dict[str, Any]) -> None:
            from peer_ort import ort_session

            self.session = ort_session(spec)  # edgeserve's session options (peers.ort_spec)
            self.name, self.out = spec["input"], spec["output"]

        def __call__(self, norm: Any) -> Any:
            return self.session.run([self.out], {self.name: norm})[0]

    @serve.deployment(**options)
    class Post:
        def __call__(self, logits: Any) -> int:
            return int(np.argmax(logits, axis=1)[0])

    @serve.deployment(**options)
    class Pipeline:
        def __init__(self, pre: Any, classifier: Any, post: Any) -> None:
            self.pre, self.classifier, self.post = pre, classifier, post  # DeploymentHandles

        async def __call__(self, request: Request) -> Any:
            shape = [int(d) for d in request.headers["x-shape"].split(",")]
            image = np.frombuffer(await request.body(), dtype=np.uint8).reshape(shape)
            norm = await self.pre.remote(image)
            logits = await self.classifier.remote(norm)
            return PlainTextResponse(str(await self.post.remote(logits)))

    pre, classifier, post, ingress = (cast(Any, d) for d in (Pre, Classifier, Post, Pipeline))  # decorated
    return ingress.bind(pre.bind(), classifier.bind(spec), post.bind())


def serve_main(spec_path: Path, port: int, ready: Path, temp_dir: Path) -> int:
    import ray
    from ray import serve

    spec = json.loads(spec_path.read_text())[0]
    stop = threading.Event()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, _node_ip_address="127.0.0.1",
             _temp_dir=str(temp_dir), log_to_driver=False, configure_logging=False)  # fmt: skip
    # after ray.init, whose own SIGTERM handler aborts the driver (no Serve shutdown, agents left behind)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(spec), name="pipeline", route_prefix=ROUTE)
        print("ray_composition: pipeline deployed", flush=True)
        ready.write_text("ready\n")
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            print("ray_composition: Serve and Ray shut down", flush=True)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--temp-dir", type=Path, required=True)
    cli = parser.parse_args()
    sys.exit(serve_main(cli.spec, cli.port, cli.ready, cli.temp_dir))
