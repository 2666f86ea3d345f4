"""The worker process of one Python model instance (Triton's "stub"): `python -m
edgeserve.backends.python.worker --control-fd N --shm-fd M --parent PID --label L`.

It imports the user's model.py (with `triton_python_backend_utils` importable as this package's
pb_utils and the version folder on sys.path, as Triton does), then answers the server's messages
one at a time (wire.py): load, auto_complete, initialize, execute, finalize. An exception in user
code is reported as that call's error and the worker lives on; only `finalize`, the end of the
control channel or the server's death (the parent pid changes) end it. It ignores SIGINT: the server
drives its life (a Ctrl-C in a terminal reaches the whole process group). Only numpy and edgeserve's
protocol helpers are imported here, never a runtime. SystemExit from user code is not caught: the
worker exits with its code, as the model asked, and the server restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from edgeserve.backends.python import group_worker, pb_utils, wire

PARENT_CHECK_S = 0.5
OOM_SCORE_ADJ = 500  # a leaking model is the OOM killer's first choice, before the server
MODULE_NAME = "triton_python_backend_utils"
STATUS_NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                "ALREADY_EXISTS", "CANCELLED")  # fmt: skip


def describe_exception(exc: BaseException, model_file: str = "") -> str:
    """The traceback's last line, with where in the model file it was raised."""
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if model_file and os.path.abspath(f.filename) == model_file]
    if mine:
        frame = mine[-1]
        line += f" ({os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return line


def _error(exc: BaseException, model_file: str) -> dict[str, Any]:
    return {"error": describe_exception(exc, model_file), "traceback": traceback.format_exc()}


class Stub:
    def __init__(self, sock: socket.socket, region: wire.Region, module_name: str = "model") -> None:
        self.sock = sock
        self.region = region
        self.module_name = module_name  # a group worker imports each member's model.py under its own name
        self.model_file = ""
        self.model_class: Any = None
        self.model: Any = None

    def serve(self) -> int:
        while True:
            try:
                message = wire.recv(self.sock)
            except (wire.PeerGone, OSError):
                return 0  # the server went away
            op = message.get("op")
            if op == "finalize":
                wire.send(self.sock, self.finalize())
                return 0
            handler = {
                "load": self.load,
                "auto_complete": self.auto_complete,
                "initialize": self.initialize,
                "execute": self.execute,
            }.get(str(op))
            if handler is None:
                reply: dict[str, Any] = {"error": f"unknown operation {op!r}"}
            else:
                reply = handler(message)
            reply["size"] = self.region.size
            if "call" in message:  # the server matches each reply to its call by this number
                reply["call"] = message["call"]
            wire.send(self.sock, reply)

    def load(self, message: dict[str, Any]) -> dict[str, Any]:
        path = os.path.abspath(str(message["model_file"]))
        self.model_file = path
        sys.argv = [path]  # a model that looks at argv sees itself, not the worker's options
        folder = os.path.dirname(path)
        clash = group_worker.helper_clash(folder) if self.module_name != "model" else None
        if clash is not None:
            return {"error": clash}
        if folder not in sys.path:
            sys.path.insert(0, folder)  # model.py may import its neighbours, as in Triton
        try:
            spec = importlib.util.spec_from_file_location(self.module_name, path)
            if spec is None or spec.loader is None:
                return {"error": f"cannot import {path}"}
            module: ModuleType = importlib.util.module_from_spec(spec)
            sys.modules[self.module_name] = module
            spec.loader.exec_module(module)
        except Exception as exc:
            return _error(exc, path)
        model_class = getattr(module, "TritonPythonModel", None)
        if model_class is None:
            return {"error": f"{os.path.basename(path)} defines no class TritonPythonModel"}
        if not callable(getattr(model_class, "execute", None)):
            return {"error": "TritonPythonModel has no execute(self, requests) method"}
        self.model_class = model_class
        return {"ok": True}

    def auto_complete(self, message: dict[str, Any]) -> dict[str, Any]:
        config = dict(message["config"])
        function = getattr(self.model_class, "auto_complete_config", None)
        if function is None:
            return {"config": config}
        try:
            result = function(pb_utils.ModelConfig(config))
        except Exception as exc:
            return _error(exc, self.model_file)
        if isinstance(result, pb_utils.ModelConfig):
            config = result.as_dict()
        return {"config": config}

    def initialize(self, message: dict[str, Any]) -> dict[str, Any]:
        try:
            model = self.model_class()
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                initialize(dict(message["args"]))
        except Exception as exc:
            return _error(exc, self.model_file)
        self.model = model
        return {"ok": True}

    def finalize(self) -> dict[str, Any]:
        finalize = getattr(self.model, "finalize", None)
        if finalize is None:
            return {"ok": True}
        try:
            finalize()
        except Exception as exc:
            return _error(exc, self.model_file)
        return {"ok": True}

    def execute(self, message: dict[str, Any]) -> dict[str, Any]:
        region = self.region
        region.follow(int(message.get("size", 0)))
        requests: list[pb_utils.InferenceRequest] = []
        end = 0
        for entry in message["requests"]:
            tensors = []
            for header in entry["inputs"]:
                tensors.append(
                    pb_utils.Tensor(str(header["n"]), wire.read_tensor(region, header, copy=False))
                )
                end = max(end, int(header["o"]) + int(header["b"]))
            requests.append(
                pb_utils.InferenceRequest(
                    tensors,
                    entry.get("outputs") or [],
                    str(entry.get("id", "")),
                    entry.get("params", "{}"),
                    correlation_id=entry.get("corrid", 0),
                    flags=int(entry.get("flags", 0)),
                )
            )
        try:
            responses = self.model.execute(requests)
        except Exception as exc:
            return {**_error(exc, self.model_file), "status": _status_of(exc)}
        if not isinstance(responses, Sequence) or isinstance(responses, (str, bytes)):
            return {
                "error": f"execute() returned {type(responses).__name__}, not a list of InferenceResponse"
            }
        if len(responses) != len(requests):
            return {"error": f"execute() returned {len(responses)} responses for {len(requests)} requests"}
        replies = []
        for response in responses:
            reply, end = self._response(response, end)
            replies.append(reply)
        return {"responses": replies}

    def _response(self, response: Any, start: int) -> tuple[dict[str, Any], int]:
        """One response's reply, its outputs written into the region from `start`; and the new end."""
        if not isinstance(response, pb_utils.InferenceResponse):
            return {
                "error": f"execute() returned a {type(response).__name__}, not an InferenceResponse"
            }, start
        error = response.error()
        if error is not None:
            code = error.code() if isinstance(error, pb_utils.TritonError) else 1
            name = STATUS_NAMES[code] if 0 <= code < len(STATUS_NAMES) else "INTERNAL"
            text = error.message() if isinstance(error, pb_utils.TritonError) else str(error)
            return {"error": text, "status": name}, start
        try:
            pairs = [(t.name(), t.as_numpy()) for t in response.output_tensors()]
            headers, end = wire.write_tensors(self.region, pairs, start)
        except Exception as exc:
            return {"error": f"cannot return the outputs: {describe_exception(exc, self.model_file)}"}, start
        return {"outputs": headers}, end


def _status_of(exc: BaseException) -> str:
    if isinstance(exc, pb_utils.TritonError) and 0 <= exc.code() < len(STATUS_NAMES):
        return STATUS_NAMES[exc.code()]
    return "INTERNAL"


def _watch_parent(parent: int) -> None:
    """Exit when the server dies (the worker is re-parented), even while user code hangs."""
    while True:
        time.sleep(PARENT_CHECK_S)
        if os.getppid() != parent:
            os._exit(70)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="edgeserve.backends.python.worker")
    parser.add_argument("--control-fd", type=int, help="one model instance's channel")
    parser.add_argument("--shm-fd", type=int, help="and its shared memory")
    parser.add_argument("--group-fd", type=int, help="a python_worker_group's channel (group_worker.py)")
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--label", default="", help="which model instance or group (for ps; not used)")
    args = parser.parse_args(argv)
    if args.group_fd is None and (args.control_fd is None or args.shm_fd is None):
        parser.error("--control-fd and --shm-fd, or --group-fd")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if os.getppid() != args.parent:
        return 70
    threading.Thread(target=_watch_parent, args=(args.parent,), name="parent-watch", daemon=True).start()
    with contextlib.suppress(OSError):  # under memory pressure the kernel kills a worker, not the server
        Path("/proc/self/oom_score_adj").write_text(str(OOM_SCORE_ADJ))
    sys.modules[MODULE_NAME] = pb_utils
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(line_buffering=True)
    if args.group_fd is not None:
        code = group_worker.serve_group(socket.socket(fileno=args.group_fd), Stub)
    else:
        code = Stub(socket.socket(fileno=args.control_fd), wire.Region(args.shm_fd)).serve()
    # Threads the model started must not hold the exit up (the server would wait, then kill).
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
