"""`edgeserve run|models|samples|detect ...`"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from edgeserve import __version__


def _run(args: argparse.Namespace) -> int:
    from edgeserve.config import ConfigError, load_settings
    from edgeserve.logs import setup_logging
    from edgeserve.server.app import Server, StartupError

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
    if args.zmq_endpoint:
        overrides["zmq"]["endpoints"] = args.zmq_endpoint
    for flag, section in (("no_http", "http"), ("no_grpc", "grpc"), ("no_zmq", "zmq")):
        if getattr(args, flag):
            overrides[section]["enabled"] = False
    if args.log_level:
        overrides["logging"]["level"] = args.log_level
    try:
        settings = load_settings(args.config, overrides=overrides)
    except ConfigError as exc:
        print(f"edgeserve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.logging.level, settings.logging.format)
    try:
        server = Server(settings)
        asyncio.run(server.serve_forever())
    except (OSError, StartupError) as exc:  # e.g. a port already in use: one line, not a traceback
        print(f"edgeserve: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _api(url: str, method: str = "GET", body: dict[str, Any] | None = None) -> Any:
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
            print(f"{'MODEL':24} {'VERSION':8} {'STATE':12} REASON")
            for entry in index:
                print(
                    f"{entry['name']:24} {entry.get('version', ''):8} {entry.get('state', ''):12} "
                    f"{entry.get('reason', '')}"
                )
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgeserve", description="Inference appliance runtime for edge devices"
    )
    parser.add_argument("--version", action="version", version=f"edgeserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="serve the model repository")
    run.add_argument("--config", type=Path, help="settings TOML file")
    run.add_argument("--model-repository", type=Path, help="model repository folder (default: models)")
    run.add_argument("--model-control-mode", choices=["explicit", "none"])
    run.add_argument("--load-model", action="append", help="model to load at start (repeatable; '*' = all)")
    run.add_argument("--host", help="address for HTTP and gRPC (default 127.0.0.1)")
    run.add_argument("--http-port", type=int)
    run.add_argument("--grpc-port", type=int)
    run.add_argument("--zmq-endpoint", action="append", help="ZeroMQ endpoint (repeatable)")
    run.add_argument("--no-http", action="store_true")
    run.add_argument("--no-grpc", action="store_true")
    run.add_argument("--no-zmq", action="store_true")
    run.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    run.set_defaults(func=_run)

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
    detect.add_argument("--json", action="store_true")
    detect.set_defaults(func=_detect)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
