"""`edgeserve run|serve|config|models|samples|detect ...`"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeserve import __version__

if TYPE_CHECKING:
    from edgeserve.config import Settings


def _overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    overrides: dict[str, dict[str, Any]] = {"server": {}, "http": {}, "grpc": {}, "zmq": {}, "logging": {}}
    if args.model_repository:
        overrides["server"]["model_repository"] = str(args.model_repository)
    if args.model_control_mode:
        overrides["server"]["model_control_mode"] = args.model_control_mode
    if args.load_model:
        overrides["server"]["load_models"] = args.load_model
    if args.host:
        overrides["http"]["host"] = args.host
        overrides["grpc"]["host"] = args.host
    if args.http_port is not None:
        overrides["http"]["port"] = args.http_port
    if args.grpc_port is not None:
        overrides["grpc"]["port"] = args.grpc_port
    if args.metrics_port is not None:
        overrides["metrics"] = {"port": args.metrics_port}
    if args.zmq_endpoint:
        overrides["zmq"]["endpoints"] = args.zmq_endpoint
    for flag, section in (("no_http", "http"), ("no_grpc", "grpc"), ("no_zmq", "zmq")):
        if getattr(args, flag):
            overrides[section]["enabled"] = False
    if args.log_level:
        overrides["logging"]["level"] = args.log_level
    if args.state_dir:
        overrides["server"]["state_dir"] = str(Path(args.state_dir).resolve())
    if args.http_restricted_api:
        overrides["http"]["restricted_api"] = args.http_restricted_api
    if args.grpc_restricted_protocol:
        overrides["grpc"]["restricted_protocol"] = args.grpc_restricted_protocol
    return overrides


def _config_path(args: argparse.Namespace) -> Path | None:
    """--config, else systemd's $CONFIGURATION_DIRECTORY/edgeserve.toml when it exists."""
    if args.config is not None:
        return Path(args.config)
    directory = os.environ.get("CONFIGURATION_DIRECTORY", "").split(":")[0]
    candidate = Path(directory) / "edgeserve.toml" if directory else None
    return candidate if candidate is not None and candidate.is_file() else None


def _settings_loader(args: argparse.Namespace) -> Callable[[], tuple[Settings, dict[str, str]]]:
    """Loads file + environment + these flags again each time: the same view at start and at SIGHUP."""
    from edgeserve.settings_tools import load_layered

    path, overrides = _config_path(args), _overrides(args)
    return lambda: load_layered(path, overrides)


def _serve_flags(args: argparse.Namespace) -> list[str]:
    """The `run` flags again, for the `serve` child the supervisor starts."""
    flags: list[str] = []
    path = _config_path(args)
    if path is not None:
        flags += ["--config", str(path)]
    for name in ("model_repository", "model_control_mode", "host", "http_port", "grpc_port", "metrics_port",
                 "log_level", "state_dir"):  # fmt: skip
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    for name in ("load_model", "zmq_endpoint", "http_restricted_api", "grpc_restricted_protocol"):
        for value in getattr(args, name) or []:
            flags += [f"--{name.replace('_', '-')}", value]
    for name in ("no_http", "no_grpc", "no_zmq"):
        if getattr(args, name):
            flags.append(f"--{name.replace('_', '-')}")
    return flags


def _run(args: argparse.Namespace) -> int:
    """The appliance: a small supervisor that runs `edgeserve serve` as its child and keeps it alive."""
    from edgeserve.logs import setup_logging
    from edgeserve.repository.layout import repository_problem
    from edgeserve.settings_tools import resolve_state_dir
    from edgeserve.supervisor.supervisor import Supervisor

    loader = _settings_loader(args)
    settings, sources = loader()  # a ConfigError is main()'s: one line, exit 2
    settings.server.state_dir = resolve_state_dir(settings, sources)[0]
    problem = repository_problem(settings)
    if problem is not None:  # restarting the server would not make the folder appear
        print(f"edgeserve: cannot start: {problem}", file=sys.stderr)
        return 1
    if _log_file_refused(args, settings):
        return 2
    log = settings.logging
    setup_logging(log.level, log.format, log.file, log.max_bytes, log.backups)
    return Supervisor(loader, _serve_flags(args), _config_path(args), _overrides(args)).run()


# gRPC core's EventEngine endpoints hand every read and write to threads of their own; the classic
# polling endpoints do the I/O on grpc.aio's poller thread. Measured here (2 vCPU, 8 clients, a tiny
# model, gRPC unary): ~10% less server CPU per RPC and 6-10% more RPCs/s. Set before gRPC starts;
# a GRPC_EXPERIMENTS already in the environment wins.
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"
# The pid of a process this server must not outlive (`edgeserve tune` sets it for its own server).
DIE_WITH_PARENT = "EDGESERVE_DIE_WITH_PARENT"


def _serve(args: argparse.Namespace) -> int:
    """One process, no supervisor: for containers (the engine restarts it) and tests."""
    os.environ.setdefault("GRPC_EXPERIMENTS", GRPC_EXPERIMENTS)
    from edgeserve.app import Server, StartupError
    from edgeserve.backends.memory import tune_server_process
    from edgeserve.fsutil import harden, protect_process
    from edgeserve.logs import setup_logging

    protect_process()  # what the server creates is its own, whatever the umask it was started with
    loader = _settings_loader(args)
    settings, _ = loader()  # a ConfigError is main()'s: one line, exit 2
    log = settings.logging
    supervised = args.control_socket is not None
    if supervised:
        _die_with_parent("EDGESERVE_SUPERVISED_BY", "the supervisor")
    else:  # alone, the server is the one to finish or undo an interrupted bundle install
        if _log_file_refused(args, settings):
            return 2
        _recover_bundles(settings.server.state_dir)
        if os.environ.get(DIE_WITH_PARENT):  # a server started by `edgeserve tune`
            _die_with_parent(DIE_WITH_PARENT, "its parent")
    # Under the supervisor our stderr is its pipe: it owns rotation and journald.
    setup_logging(log.level, log.format, None if supervised else log.file, log.max_bytes, log.backups)
    if not supervised:  # under the supervisor, it did this at its start
        harden(settings.server.state_dir)
        _drop_bundle_bytecode(settings.server.state_dir)
    tune_server_process(settings)  # memory settings: before any runtime is imported or a thread started
    import logging

    from edgeserve.server import eventloop

    try:
        loop = eventloop.chosen_loop(settings.server.event_loop)
        logging.getLogger("edgeserve.server").info("event loop: %s", loop)
        server = Server(settings, reload_settings=lambda: loader()[0], control_socket=args.control_socket)
        eventloop.run(server.serve_forever(), loop)
    # e.g. a port already in use: one line, not a traceback
    except (OSError, StartupError, eventloop.EventLoopError) as exc:
        print(f"edgeserve: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _log_file_refused(args: argparse.Namespace, settings: Settings) -> bool:
    """A `[logging] file` in a key folder is refused at start (a log line could become a key)."""
    from edgeserve.ota.trust import log_file_problem

    problem = log_file_problem(settings, settings.server.state_dir)
    if problem is not None:
        print(f"edgeserve: {_config_path(args) or 'settings'}: {problem}", file=sys.stderr)
    return problem is not None


def _recover_bundles(state_dir: Path) -> None:
    from edgeserve.ota.errors import StoreError
    from edgeserve.ota.installer import recover
    from edgeserve.ota.store import Store

    store = Store(state_dir)
    if not store.journal_path.exists():
        return
    try:
        with store.lock():  # an install in progress (another process) holds it: leave it alone
            done = recover(store)
    except (StoreError, OSError) as exc:
        print(f"edgeserve: bundle store {store.root}: {exc}", file=sys.stderr)
        return
    if done:
        print(f"edgeserve: bundle install {done}", file=sys.stderr)


def _drop_bundle_bytecode(state_dir: Path) -> None:
    from edgeserve.ota.store import Store

    with contextlib.suppress(OSError):
        for removed in Store(state_dir).drop_bytecode():
            print(f"edgeserve: bundle store: removed {removed} (old bytecode)", file=sys.stderr)


def _die_with_parent(variable: str, parent: str) -> None:
    """SIGTERM this process when its parent (whose pid `variable` holds) dies, even by SIGKILL (Linux
    prctl PR_SET_PDEATHSIG). Set here, not in a preexec_fn: a fork that runs Python before exec runs
    grpc's fork handlers, whose poller thread then dies on the fds close_fds closed (SIGABRT)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    expected = os.environ.get(variable, "")
    if expected and str(os.getppid()) != expected:  # it died before prctl took effect, or a stale value
        from edgeserve.logs import safe

        raise SystemExit(
            f"edgeserve serve: {parent} is gone ({variable} names {safe(expected, 40)}, "
            f"the parent is pid {os.getppid()})"
        )


def _config(args: argparse.Namespace) -> int:
    """`edgeserve config check`: validate, then print the effective settings and where each came from.
    `edgeserve config reference`: every setting as Markdown (the docs' settings reference)."""
    if args.action == "reference":
        from edgeserve.settings_reference import main

        return main(args.out)
    from edgeserve.config import ConfigError
    from edgeserve.settings_tools import load_layered, render_effective, resolve_state_dir

    path = _config_path(args)
    try:
        settings, sources = load_layered(path)
    except ConfigError as exc:
        print(f"edgeserve config: {exc}", file=sys.stderr)
        return 2
    state_dir, why = resolve_state_dir(settings, sources)
    from edgeserve.ota.trust import log_file_problem

    problem = log_file_problem(settings, state_dir)
    if problem is not None:  # `run` would refuse to start
        print(f"edgeserve config: {path or 'settings'}: {problem}", file=sys.stderr)
        return 2
    print(f"# {path or 'no settings file'}: valid", end="")
    print(f"; state folder {state_dir} ({why})" if state_dir != settings.server.state_dir else "")
    print(render_effective(settings, sources), end="")
    from edgeserve.settings_warnings import risky_settings

    for warning in risky_settings(settings):
        print(f"edgeserve config: warning: {warning}", file=sys.stderr)
    return 0


def _api(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        url, data=data, method=method, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            raw = response.read()
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        with contextlib.suppress(ValueError, KeyError):
            detail = json.loads(detail)["error"]
        raise SystemExit(f"edgeserve: {method} {url}: {exc.code}: {detail}") from None
    except urllib.error.URLError as exc:
        raise SystemExit(
            f"edgeserve: cannot reach {url}: {exc.reason} (is `edgeserve run` running?)"
        ) from None
    return json.loads(raw) if raw else None


def _models(args: argparse.Namespace) -> int:
    base = args.url.rstrip("/")
    if args.action == "list":
        index = _api(f"{base}/v2/repository/index", "POST", {})
        if args.json:
            print(json.dumps(index, indent=2))
        else:
            from edgeserve.procmem import print_breakdown
            from edgeserve.repository.residency_cli import print_index

            print_index(index, base)
            print_breakdown(base)  # memory per process and per model
        return 0
    if not args.name:
        raise SystemExit(f"edgeserve: models {args.action} needs a model name")
    body: dict[str, Any] = {}
    if args.action == "load" and args.config_file:
        body = {"parameters": {"config": Path(args.config_file).read_text()}}
    print(f"{args.action}ing {args.name} ...", flush=True)
    _api(f"{base}/v2/repository/models/{args.name}/{args.action}", "POST", body)
    print(f"{args.name}: {args.action}ed")
    return 0


def _samples(args: argparse.Namespace) -> int:
    from edgeserve.samples import prepare

    prepare(Path(args.model_repository), with_ppocr=not args.no_ppocr)
    return 0


def _detect(args: argparse.Namespace) -> int:
    from edgeserve.hardware.cli import detect_command

    return detect_command(args)


def _server_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="settings TOML file")
    parser.add_argument("--model-repository", type=Path, help="model repository folder (default: models)")
    parser.add_argument("--model-control-mode", choices=["explicit", "none"])
    parser.add_argument(
        "--load-model", action="append", help="model to load at start (repeatable; '*' = all)"
    )
    parser.add_argument("--host", help="address for HTTP and gRPC (default 127.0.0.1)")
    parser.add_argument("--http-port", type=int)
    parser.add_argument("--grpc-port", type=int)
    parser.add_argument("--metrics-port", type=int, help="Triton's metrics port (default 8002; 0 = off)")
    parser.add_argument("--zmq-endpoint", action="append", help="ZeroMQ endpoint (repeatable)")
    parser.add_argument("--no-http", action="store_true")
    parser.add_argument("--no-grpc", action="store_true")
    parser.add_argument("--no-zmq", action="store_true")
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--state-dir", type=Path, help="state folder: OTA bundles, runtime plan, caches")
    _restricted_flag(parser, "http-restricted-api", "api", "HTTP header '<key>: <value>'")
    _restricted_flag(
        parser, "grpc-restricted-protocol", "protocol", "gRPC metadata 'triton-grpc-protocol-<key>'"
    )


def _restricted_flag(parser: argparse.ArgumentParser, option: str, feature: str, carries: str) -> None:
    """Triton's `--<option>=<category>[,<category>...]:<key>=<value>` (repeatable)."""
    from edgeserve.protocol.restricted import CATEGORIES, parse_group

    def group(value: str) -> str:
        try:
            parse_group(value, option, feature)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    parser.add_argument(
        f"--{option}", action="append", type=group, metavar="<category>[,...]:<key>=<value>",
        help=f"requests of these categories must carry the {carries} (repeatable; categories: "
        f"{', '.join(CATEGORIES)}); as Triton's flag",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeserve", description="Inference appliance runtime for edge devices"
    )
    parser.add_argument("--version", action="version", version=f"edgeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the appliance: a supervisor that keeps the server alive")
    _server_flags(run)
    run.set_defaults(func=_run)

    serve = sub.add_parser("serve", help="serve in this one process (containers, tests): no supervisor")
    _server_flags(serve)
    serve.add_argument("--control-socket", type=Path, help=argparse.SUPPRESS)  # set by the supervisor
    serve.set_defaults(func=_serve)

    config = sub.add_parser("config", help="check: validate settings, print them; reference: document them")
    config.add_argument("action", choices=["check", "reference"])
    config.add_argument("--config", type=Path, help="settings TOML file")
    config.add_argument("--out", type=Path, help="reference: write this Markdown file instead of stdout")
    config.set_defaults(func=_config)

    from edgeserve.fleet.fleet_cli import add_commands as add_fleet_commands
    from edgeserve.ota.cli import add_commands

    add_commands(sub, lambda p: p.add_argument("--config", type=Path, help="settings TOML file"))
    add_fleet_commands(sub)

    models = sub.add_parser("models", help="list, load or unload models on a running server")
    models.add_argument("action", choices=["list", "load", "unload"])
    models.add_argument("name", nargs="?")
    models.add_argument("--url", default="http://127.0.0.1:8000")
    models.add_argument("--config-file", help="load: a JSON model config to use instead of config.pbtxt")
    models.add_argument("--json", action="store_true")
    models.set_defaults(func=_models)

    samples = sub.add_parser("samples", help="build/extract the sample models into the model repository")
    samples.add_argument("--model-repository", default="models")
    samples.add_argument("--no-ppocr", action="store_true", help="only the generated MLP")
    samples.set_defaults(func=_samples)

    detect = sub.add_parser("detect", help="probe the hardware and print the runtime plan")
    detect.add_argument(
        "--root", type=Path, default=Path("/"), help="filesystem root to probe (tests, fixtures)"
    )
    detect.add_argument("--model-repository", type=Path, default=Path("models"))
    detect.add_argument(
        "--model", type=Path, help="a model folder: race its candidates here (or read the cached race)"
    )
    detect.add_argument("--fresh", action="store_true", help="with --model: race again, ignoring the cache")
    detect.add_argument("--json", action="store_true")
    detect.set_defaults(func=_detect)

    from edgeserve.bench.cli import add_commands as add_bench_commands  # stdlib only at import time

    add_bench_commands(sub)

    from edgeserve.video.cli import add_commands as add_watch_commands  # PyAV only when it runs

    add_watch_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from edgeserve.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:  # a settings error is one line and exit 2, in every command
        print(f"edgeserve: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
