"""The PyTriton peer for bench_grpc.py: a real `tritonserver` (bundled in the nvidia-pytriton wheel) whose
Python models call the same runtime, with the same options and instance count, as the edgeserve side.

The benchmark process builds one spec per model (`peer_spec`: batching read from the model's config.pbtxt,
backend/options/instances from common.InProcess), writes them to a JSON file and starts

    <venv>/bin/python benchmarks/pytriton_peer.py SPEC.json --http-port P --grpc-port Q

from a throwaway venv (`pytriton_python` creates it once with --system-site-packages, so edgeserve's
runtimes are the same packages). PyTriton pins numpy < 2 in that venv; edgeserve's backends import fine
with it. Loopback only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, InProcess, Workload, free_port, read_config

PYTRITON_VERSION = "0.7.0"
DEFAULT_VENV = Path.home() / ".cache" / "edgeserve-bench" / "pytriton-venv"


def pytriton_python(venv: Path, install: bool) -> tuple[str | None, str]:
    """(python of a venv where `import pytriton` and edgeserve's runtimes work, or None; why not).
    Created on first use with --system-site-packages; the runtimes are pinned to the versions this
    interpreter runs (the base interpreter has none of them)."""
    from peers import ensure_venv, runtime_pin

    packages = [f"nvidia-pytriton=={PYTRITON_VERSION}", runtime_pin("onnxruntime"), runtime_pin("openvino"),
                "psutil"]  # fmt: skip
    check = "import pytriton, onnxruntime, openvino, numpy, psutil"
    return ensure_venv(venv, packages, check, install, system_site=True)


def peer_spec(config_path: Path, work: Workload, inproc: InProcess) -> dict[str, Any]:
    """What the peer serves for one model: tensors and batching as in the config edgeserve serves it
    with (`config_path`, read, not hard-coded: the sample configs change), and the in-process side's
    backend, options and instance count."""
    config = read_config(config_path)
    inputs = {t.name: list(t.dims) for t in config.input}
    outputs = {t.name: list(t.dims) for t in config.output}
    batching = config.dynamic_batching if config.HasField("dynamic_batching") else None
    options = dataclasses.asdict(inproc.options)
    options["cache_dir"] = str(options["cache_dir"]) if options["cache_dir"] else None
    return {
        "model": work.model,
        "input": work.input_name,
        "output": work.output_name,
        "input_dims": inputs[work.input_name],
        "output_dims": outputs[work.output_name],
        "max_batch_size": int(config.max_batch_size),
        "max_queue_delay_us": int(batching.max_queue_delay_microseconds) if batching else 0,
        "preferred_batch_size": [int(b) for b in batching.preferred_batch_size] if batching else [],
        "instances": len(inproc.instances),
        "config_path": str(config_path),
        "model_path": str(inproc.model_path),
        "backend": inproc.backend,
        "options": options,
    }


def describe_peer(spec: dict[str, Any]) -> str:
    if spec["max_batch_size"] > 0:
        preferred = ",".join(map(str, spec["preferred_batch_size"])) or "-"
        batching = (f"max_batch_size {spec['max_batch_size']}, preferred {preferred}, "
                    f"delay {spec['max_queue_delay_us']} us")  # fmt: skip
    else:
        batching = "no batching (max_batch_size 0)"
    return f"{spec['model']} {batching}, {spec['instances']} instance(s) of {spec['backend']}"


def start(
    python: str, specs: list[dict[str, Any]], new_session: bool = False
) -> tuple[subprocess.Popen[bytes], int, int, Path]:
    """Start the peer process (not waiting for it): (process, http port, grpc port, log file).
    `new_session`: in a process group of its own (bench_peers.py stops that group)."""
    http_port, grpc_port = free_port(), free_port()
    workdir = Path(tempfile.mkdtemp(prefix="pytriton-bench-"))
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(specs, indent=1))
    log_path = workdir / "pytriton.log"
    base = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    # The bundled tritonserver's Python stub may load the system libpython: point it at this one's.
    libdir = base or str(sysconfig.get_config_var("LIBDIR"))
    env = {
        **os.environ,
        "LD_LIBRARY_PATH": ":".join(p for p in (libdir, os.environ.get("LD_LIBRARY_PATH")) if p),
    }
    cmd = [python, str(Path(__file__).resolve()), str(spec_path), "--http-port", str(http_port),
           "--grpc-port", str(grpc_port)]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env, start_new_session=new_session
        )
    return process, http_port, grpc_port, log_path


def _infer_func(instance: Any, spec: dict[str, Any]) -> Callable[..., Any]:
    from pytriton.decorators import batch

    name, out = spec["input"], spec["output"]
    if spec["max_batch_size"] > 0:

        @batch  # type: ignore[untyped-decorator]
        def infer_batch(**inputs: np.ndarray) -> dict[str, np.ndarray]:
            return {out: instance.infer({name: inputs[name]})[out]}

        return infer_batch  # type: ignore[no-any-return]

    def infer_each(requests: list[Any]) -> list[dict[str, np.ndarray]]:  # unbatched: one request each
        return [{out: instance.infer({name: request[name]})[out]} for request in requests]

    return infer_each


def serve(spec_path: Path, http_port: int, grpc_port: int) -> int:
    """Inside the venv: bind every spec'd model and serve until SIGTERM."""
    from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
    from pytriton.triton import Triton, TritonConfig

    from edgeserve.backends.base import BackendOptions, get_backend

    specs = json.loads(spec_path.read_text())
    workspace = Path(tempfile.gettempdir()) / f"pytriton-ws-{os.getpid()}-{time.time_ns()}"  # must not exist
    config = TritonConfig(
        http_address="127.0.0.1",
        http_port=http_port,
        grpc_address="127.0.0.1",
        grpc_port=grpc_port,
        allow_metrics=False,
        exit_timeout_secs=10,
    )
    with Triton(config=config, workspace=str(workspace)) as triton:
        for spec in specs:
            opts = dict(spec["options"])
            opts["providers"] = tuple(opts["providers"])
            opts["cache_dir"] = Path(opts["cache_dir"]) if opts["cache_dir"] else None
            options = BackendOptions(**opts)
            backend = get_backend(spec["backend"])
            model_config = read_config(Path(spec["config_path"]))
            instances = [backend.load(Path(spec["model_path"]), model_config, options)
                         for _ in range(spec["instances"])]  # fmt: skip
            if spec["max_batch_size"] > 0:
                batcher = DynamicBatcher(
                    max_queue_delay_microseconds=spec["max_queue_delay_us"],
                    preferred_batch_size=spec["preferred_batch_size"] or None,
                )
                triton_config = ModelConfig(max_batch_size=spec["max_batch_size"], batcher=batcher)
            else:  # the model's own batch axis is in the tensor shapes below
                triton_config = ModelConfig(batching=False)
            triton.bind(
                model_name=spec["model"],
                infer_func=[_infer_func(instance, spec) for instance in instances],
                inputs=[Tensor(name=spec["input"], dtype=np.float32, shape=tuple(spec["input_dims"]))],
                outputs=[Tensor(name=spec["output"], dtype=np.float32, shape=tuple(spec["output_dims"]))],
                config=triton_config,
            )
            print(f"pytriton: {describe_peer(spec)}, {options}", flush=True)
        triton.serve()
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", type=Path)
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    cli = parser.parse_args()
    raise SystemExit(serve(cli.spec, cli.http_port, cli.grpc_port))
