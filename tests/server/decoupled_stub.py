"""An in-process stand-in for the Python backend's decoupled models, for the serving-side tests of
issue 35 (gRPC streams, generate/SSE, ZeroMQ multi-part, BLS calls): it stands in for the Python
backend only until H1's decoupled Python models land (edgeserve/backends/python); then the end-to-end
tests with real `model.py` files through tritonclient take over.

`install()` (run in the server process by stub_site/sitecustomize.py) replaces the "python" backend:
a model folder's `1/model.py` is imported in the server and its `Model(config, model_dir)` is the
instance (a StreamingInstance when it has `infer_decoupled`). `start_stub_server` starts a real
`edgeserve serve` on loopback with it.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from es_server import RunningServer

HERE = Path(__file__).resolve().parent
_counter = itertools.count()


class InProcessPython:
    name = "python"
    platforms: tuple[str, ...] = ()
    artifacts: tuple[str, ...] = ("model.py",)

    def unavailable_reason(self) -> str | None:
        return None

    def inspect(self, model_path: Path) -> Any:
        from edgeserve.backends.python.backend import declared_io
        from edgeserve.protocol.model_config import parse_pbtxt

        return declared_io(parse_pbtxt(model_path.parent.parent / "config.pbtxt"))

    def load(self, model_path: Path, config: Any, options: Any) -> Any:
        spec = importlib.util.spec_from_file_location(f"stub_model_{next(_counter)}", model_path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        instance = module.Model(config, model_path.parent.parent)
        instance.io = self.inspect(model_path)
        return instance


def install() -> None:
    from edgeserve.backends import base

    base._loaded["python"] = InProcessPython()


def start_stub_server(repository: Path, tmp: Path, **kwargs: Any) -> RunningServer:
    from es_server import start_server  # not in the server process (sitecustomize imports this module)

    path = os.pathsep.join([str(HERE / "stub_site"), str(HERE), os.environ.get("PYTHONPATH", "")])
    env = {"PYTHONPATH": path, **kwargs.pop("env", {})}
    return start_server(repository, tmp, env=env, **kwargs)


def write_model(repo: Path, name: str, config: str, source: str) -> None:
    folder = repo / name / "1"
    folder.mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "python"\n' + config)
    (folder / "model.py").write_text(source)
