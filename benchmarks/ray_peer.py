"""The Ray Serve peer of bench_peers.py: one deployment per model whose replicas hold an ONNX Runtime
session built with edgeserve's options (peer_ort.ort_session), batching with `@serve.batch`
(max_batch_size and batch_wait_timeout_s = max_queue_delay_microseconds from the model's config.pbtxt)
when the model batches, behind Ray Serve's HTTP proxy on 127.0.0.1 at route `/<model>`. Replicas = the
instance count. The route takes a KServe-V2-shaped JSON body ({"inputs": [{"name", "shape",
"datatype", "data"}]}) and answers the same shape, or the raw float32 bytes (content-type
application/octet-stream, shape in an `x-shape` header) and answers raw bytes.

    <ray venv>/bin/python benchmarks/ray_peer.py SPEC.json --port P --ready FILE

Ray starts its own services (GCS, raylet, workers, the Serve controller and proxy) and binds some of
them to every interface whatever it is asked: bench_peers.py runs it only inside a network namespace
that has nothing but `lo` (see there). The launcher half of this file runs in edgeserve's venv; the
serving half (`serve`) in the Ray venv, importing only ray, numpy, starlette and peer_ort.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

VERSION = "2.60.0"
HERE = Path(__file__).resolve().parent
TRANSPORTS = ("HTTP aiohttp JSON", "HTTP aiohttp raw")


def prepare(venv_dir: Path | None = None, install: bool = True) -> tuple[str | None, str]:
    from peers import VENV_DIR, ensure_venv, runtime_pin

    packages = [f"ray[serve]=={VERSION}", runtime_pin("onnxruntime")]
    return ensure_venv(
        (venv_dir or VENV_DIR) / "ray-venv", packages, "import ray.serve, onnxruntime", install
    )


def start(python: str, specs: list[dict[str, Any]]) -> tuple[Any, dict[str, str], Path]:
    """Start the peer (not waiting): (PeerProcess, {transport: address}, ready marker file)."""
    import tempfile

    from common import free_port
    from peers import PeerProcess, write_specs

    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="ray-bench-"))
    spec_path = write_specs(specs, workdir)
    marker = workdir / "ready"
    env = {
        "PYTHONPATH": str(HERE),
        "RAY_worker_niceness": "0",  # Ray renices its workers by default; edgeserve is not reniced
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        "RAY_DEDUP_LOGS": "0",
    }
    cmd = [
        python,
        str(Path(__file__).resolve()),
        str(spec_path),
        "--port",
        str(port),
        "--ready",
        str(marker),
        "--temp-dir",
        str(workdir / "ray"),
    ]
    process = PeerProcess("ray", cmd, env=env)
    process.ready_urls = [f"http://127.0.0.1:{port}/-/healthz"]
    address = f"127.0.0.1:{port}"
    return process, dict.fromkeys(TRANSPORTS, address), marker


# -- inside the Ray venv ----------------------------------------------------------------------------------
def build_app(spec: dict[str, Any]) -> Any:
    import numpy as np
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response

    @serve.deployment(
        name=spec["model"],
        num_replicas=spec["instances"],
        max_ongoing_requests=256,
        ray_actor_options={"num_cpus": 0},
    )
    class OrtDeployment:
        def __init__(self, spec: dict[str, Any]) -> None:
            from peer_ort import ort_session

            self.spec = spec
            self.session = ort_session(spec)
            self.name, self.out = spec["input"], spec["output"]
            self.batching = spec["max_batch_size"] > 1
            if self.batching:
                self.batched.set_max_batch_size(spec["max_batch_size"])
                self.batched.set_batch_wait_timeout_s(spec["max_queue_delay_us"] / 1e6)

        def run(self, x: Any) -> Any:
            return self.session.run([self.out], {self.name: x})[0]

        @serve.batch(max_batch_size=8, batch_wait_timeout_s=0.0001)  # type: ignore[misc]
        async def batched(self, xs: list[Any]) -> list[Any]:
            y = self.run(np.concatenate(xs))
            return list(np.split(y, np.cumsum([len(x) for x in xs])[:-1]))

        async def infer(self, x: Any) -> Any:
            return await self.batched(x) if self.batching else self.run(x)

        async def __call__(self, request: Request) -> Any:
            body = await request.body()
            if request.headers.get("content-type", "").startswith("application/octet-stream"):
                shape = [int(d) for d in request.headers["x-shape"].split(",")]
                y = await self.infer(np.frombuffer(body, dtype=np.float32).reshape(shape))
                y = np.ascontiguousarray(y, dtype=np.float32)
                return Response(
                    y.tobytes(),
                    media_type="application/octet-stream",
                    headers={"x-shape": ",".join(map(str, y.shape))},
                )
            tensor = json.loads(body)["inputs"][0]
            y = await self.infer(np.asarray(tensor["data"], dtype=np.float32).reshape(tensor["shape"]))
            out = {"name": self.out, "shape": list(y.shape), "datatype": "FP32", "data": y.ravel().tolist()}
            return JSONResponse({"model_name": self.spec["model"], "outputs": [out]})

    return OrtDeployment.bind(spec)


def serve_main(spec_path: Path, port: int, ready: Path, temp_dir: Path) -> int:
    import ray
    from ray import serve

    specs = json.loads(spec_path.read_text())
    stop = threading.Event()
    ray.init(
        num_cpus=os.cpu_count(),
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _temp_dir=str(temp_dir),
        log_to_driver=False,
        configure_logging=False,
    )
    # after ray.init, which installs its own SIGTERM handler (it aborts the driver: Serve never shut
    # down and its agents were left for the stop code to kill)
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for spec in specs:
            serve.run(build_app(spec), name=spec["model"], route_prefix=f"/{spec['model']}")
            print(f"ray_peer: {spec['model']} deployed", flush=True)
        ready.write_text("ready\n")
        while not stop.wait(0.5):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--ready", type=Path, required=True)
    parser.add_argument("--temp-dir", type=Path, required=True)
    cli = parser.parse_args()
    sys.exit(serve_main(cli.spec, cli.port, cli.ready, cli.temp_dir))
