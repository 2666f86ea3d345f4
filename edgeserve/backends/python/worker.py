"""The worker process of one Python model instance (Triton's "stub"): `python -m
edgeserve.backends.python.worker --control-fd N --shm-fd M --parent PID --label L`.

It imports the user's model.py (with `triton_python_backend_utils` importable as this package's
pb_utils and the version folder on sys.path, as Triton does), then answers the server's messages
one at a time (wire.py): load, auto_complete, initialize, execute, finalize. Meanwhile the model's
decoupled responses, BLS calls and metrics go out on the event channel (channel.py), and coroutine
methods (`async def execute/initialize/finalize`) run on the worker's event loop (aloop.py).
An exception in user code is reported as that call's error and the worker lives on; only
`finalize`, the end of the control channel or the server's death (the parent pid changes) end it.
It ignores SIGINT: the server
drives its life (a Ctrl-C in a terminal reaches the whole process group). Only numpy and edgeserve's
protocol helpers are imported here, never a runtime. SystemExit from user code is not caught: the
worker exits with its code, as the model asked, and the server restarts it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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

from edgeserve.backends.python import aloop, group_worker, pb_bls, pb_utils, wire
from edgeserve.backends.python.callref import CallRegion
from edgeserve.backends.python.channel import Channel

PARENT_CHECK_S = 0.5
OOM_SCORE_ADJ = 500  # a leaking model is the OOM killer's first choice, before the server
MODULE_NAME = "triton_python_backend_utils"
STATUS_NAMES = ("UNKNOWN", "INTERNAL", "NOT_FOUND", "INVALID_ARG", "UNAVAILABLE", "UNSUPPORTED",
                "ALREADY_EXISTS", "CANCELLED")  # fmt: skip


def describe_exception(exc: BaseException, model_file: str = "") -> str:
    """The traceback's last line, with where in the model file it was raised."""
    line = traceback.format_exception_only(type(exc), exc)[-1].strip()
    if type(exc).__module__.startswith("edgeserve.backends.python."):  # pb_utils' own: named as Triton does
        line = line.removeprefix(f"{type(exc).__module__}.")
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if model_file and os.path.abspath(f.filename) == model_file]
    if mine:
        frame = mine[-1]
        line += f" ({os.path.basename(frame.filename)}:{frame.lineno} in {frame.name})"
    return line


def _error(exc: BaseException, model_file: str) -> dict[str, Any]:
    return {"error": describe_exception(exc, model_file), "traceback": traceback.format_exc()}


class Stub:
    def __init__(
        self, sock: socket.socket, region: wire.Region, module_name: str = "model",
        events: tuple[socket.socket, wire.Region] | None = None,
    ) -> None:  # fmt: skip
        self.sock = sock
        self.region = region
        self.module_name = module_name  # a group worker imports each member's model.py under its own name
        self.model_file = ""
        self.model_class: Any = None
        self.model: Any = None
        self.link: pb_bls.Link | None = None
        if events is not None:
            channel = Channel(events[0], events[1], "worker", module_name)
            channel.start()
            self.link = pb_bls.Link(channel, "", call_region=CallRegion(region))
            pb_bls.register(self.link)

    def _user(self, function: Any, *args: Any, link: pb_bls.Link | None = None) -> Any:
        """Call user code with its link as the context (BLS, metrics); a coroutine it returns is run
        to its end on the event loop."""
        token = pb_bls.current.set(link or self.link)
        try:
            result = function(*args)
        finally:
            pb_bls.current.reset(token)
        if aloop.is_coroutine(result):
            return aloop.run(result, link or self.link)
        return result

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
        if self.link is not None:
            self.link.model_dir = os.path.dirname(path)
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
            result = self._user(function, pb_utils.ModelConfig(config))
        except Exception as exc:
            return _error(exc, self.model_file)
        if isinstance(result, pb_utils.ModelConfig):
            config = result.as_dict()
        return {"config": config}

    def initialize(self, message: dict[str, Any]) -> dict[str, Any]:
        args = dict(message["args"])
        if self.link is not None:
            self.link.model = str(args.get("model_name", ""))
        try:
            model = self._user(self.model_class)
            initialize = getattr(model, "initialize", None)
            if initialize is not None:
                self._user(initialize, args)
        except Exception as exc:
            return _error(exc, self.model_file)
        self.model = model
        return {"ok": True}

    def finalize(self) -> dict[str, Any]:
        finalize = getattr(self.model, "finalize", None)
        if finalize is None:
            return {"ok": True}
        try:
            self._user(finalize)
        except Exception as exc:
            return _error(exc, self.model_file)
        return {"ok": True}

    def execute(self, message: dict[str, Any]) -> dict[str, Any]:
        region = self.region
        region.follow(int(message.get("size", 0)))
        decoupled = bool(message.get("decoupled"))
        if decoupled and self.link is None:
            return {"error": "a decoupled model needs the event channel"}
        # A decoupled model may read its inputs after execute() returned (from its own thread, or an
        # async execute still running): they are copied out of the region the next call reuses.
        requests: list[pb_utils.InferenceRequest] = []
        chain: list[str] = []
        end = 0
        for entry in message["requests"]:
            tensors = []
            for header in entry["inputs"]:
                array = wire.read_tensor(region, header, copy=decoupled)
                tensors.append(pb_utils.Tensor(str(header["n"]), array))
                end = max(end, int(header["o"]) + int(header["b"]))
            request = pb_utils.InferenceRequest(
                request_id=str(entry.get("id", "")), correlation_id=entry.get("corrid", 0), inputs=tensors,
                requested_output_names=entry.get("outputs") or [], flags=int(entry.get("flags", 0)),
                parameters=entry.get("params", "{}"),
            )  # fmt: skip
            chain.extend(c for c in str(entry.get("chain", "")).split(",") if c and c not in chain)
            if decoupled and self.link is not None:
                request._sender = pb_bls.InferenceResponseSender(self.link, int(entry["rid"]))
            requests.append(request)
        link = self.link
        if link is not None:
            mine = [*chain, link.model] if link.model not in chain else chain
            link = dataclasses.replace(link, chain=",".join(mine))
        if decoupled:
            return self._execute_decoupled(requests, link, [int(e["rid"]) for e in message["requests"]])
        calls = link.call_region if link is not None else None
        if calls is not None:
            calls.open()  # BLS calls may name these inputs in place (callref.py)
        try:
            responses = self._user(self.model.execute, requests, link=link)
        except Exception as exc:
            return {**_error(exc, self.model_file), "status": _status_of(exc)}
        finally:
            if calls is not None:
                calls.close()  # the server reuses the region after this reply: no call may still read it
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

    def _execute_decoupled(
        self, requests: list[pb_utils.InferenceRequest], link: pb_bls.Link | None, rids: list[int]
    ) -> dict[str, Any]:
        """Triton's decoupled execute: responses go through the senders; it returns None. An async
        execute is left running on the event loop (the instance takes the next batch meanwhile), and a
        failure after this reply reaches the requests that have not ended as their error."""
        token = pb_bls.current.set(link)
        try:
            result = self.model.execute(requests)
        except Exception as exc:
            return {**_error(exc, self.model_file), "status": _status_of(exc)}
        finally:
            pb_bls.current.reset(token)
        if aloop.is_coroutine(result):
            assert link is not None
            aloop.start(result, link, lambda exc: self._failed_later(link, rids, exc))
            return {"ok": True}
        if result is not None:
            return {"error": f"execute() of a decoupled model returned {type(result).__name__}; it must "
                             "return None and send responses with request.get_response_sender()"}  # fmt: skip
        return {"ok": True}

    def _failed_later(self, link: pb_bls.Link, rids: list[int], exc: BaseException | None) -> None:
        """An async decoupled execute ended: with an exception, the requests still open get it."""
        if exc is None:
            return
        text = describe_exception(exc, self.model_file)
        pb_utils.Logger.log_error(f"model '{link.model}': async execute() raised: {text}")
        with contextlib.suppress(ConnectionError):
            link.channel.post({"op": "failed", "r": rids, "error": text, "status": _status_of(exc)})

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
    parser.add_argument("--event-fd", type=int, help="its event channel (channel.py)")
    parser.add_argument("--event-shm-fd", type=int, help="and that channel's shared memory")
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
        events = None
        if args.event_fd is not None and args.event_shm_fd is not None:
            events = (socket.socket(fileno=args.event_fd), wire.Region(args.event_shm_fd))
        code = Stub(socket.socket(fileno=args.control_fd), wire.Region(args.shm_fd), events=events).serve()
    # Threads the model started must not hold the exit up (the server would wait, then kill).
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
