"""`edgeserve fleet ...`: the fleet operator's commands over MQTT (see ota/fleet.md).

    edgeserve fleet devices
    export EDGESERVE_FLEET_KEY=/secure/keys/fleet-commands.key   # or --key on each command
    edgeserve fleet send cam-01 get_status
    edgeserve fleet send cam-01 set_config '{"logging": {"level": "DEBUG"}}'  # allowlist: config_allowlist.py
    edgeserve fleet send cam-01 revoke_key '{"key_id": "<16 hex>", "role": "bundle"}'
    edgeserve fleet deploy https://repo/bundle-v8.tar --devices 'cam-*' --canary 10% --wave-size 20 \
        --pause 30 --max-failure-ratio 0.05 --sha256 <hex>
    edgeserve fleet desired cam-01 '{"generation": 8, "bundle": {"url": "https://repo/bundle-v8.tar"}}'
    edgeserve fleet watch --seconds 60

What devices publish is printed escaped (cli_text.py): no broker publisher writes on the operator's
terminal.

Every command and desired state is signed with the private command key (`edgeserve keygen --role
command`); devices refuse unsigned ones unless `[fleet] require_signed_commands = false` (a lab setting).

`add_commands(sub)` registers `fleet` on the top-level argparse subparsers; `main(argv)` runs the
`fleet` command alone (tests, `python -m edgeserve.fleet.fleet_cli`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from edgeserve.fleet.cli_text import describe as _describe
from edgeserve.fleet.cli_text import progress_line as _progress_line
from edgeserve.fleet.cli_text import text as _t
from edgeserve.fleet.cli_text import version as _v
from edgeserve.fleet.protocol import SUCCEEDED, VERBS

ENV_BROKER = "EDGESERVE_FLEET_BROKER"
ENV_FLEET = "EDGESERVE_FLEET_FLEET"
ENV_KEY = "EDGESERVE_FLEET_KEY"
DEFAULT_BROKER = "mqtt://127.0.0.1:1883"


def _common_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("broker")
    group.add_argument(
        "--broker",
        default=None,
        help=f"mqtt://host:port or mqtts://host:port (default: ${ENV_BROKER} or {DEFAULT_BROKER})",
    )
    group.add_argument(
        "--fleet", default=None, help=f"fleet name, the topic level after es/v1/ (or ${ENV_FLEET})"
    )
    group.add_argument("--username")
    group.add_argument("--password", help="or $EDGESERVE_FLEET_PASSWORD")
    group.add_argument("--ca-file", help="CA certificate(s) that signed the broker's certificate (PEM)")
    group.add_argument("--cert-file", help="client certificate (PEM) for brokers that require one")
    group.add_argument("--key-file", help="the client certificate's private key (PEM)")
    group.add_argument("--protocol", choices=["5", "3.1.1"], default="5", help="MQTT version (default 5)")
    group.add_argument("--client-id", help="MQTT client id of this manager (default: random mgr-...)")
    parser.add_argument("--json", action="store_true", help="machine-readable output (JSON lines)")


def _signing_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("signing")
    group.add_argument("--key", "--command-key", dest="command_key", metavar="PATH",
                       help=f"private command key (PEM, from `edgeserve keygen --role command`) that signs "
                            f"what is sent (default: ${ENV_KEY}); not the TLS --key-file")  # fmt: skip
    group.add_argument("--unsigned", action="store_true",
                       help="send unsigned: only lab devices with [fleet] require_signed_commands = false "
                            "accept it")  # fmt: skip


def _percent(value: str) -> float:
    return _number(value.strip().removesuffix("%"), 100, f"{value!r} is not a percentage (e.g. 10%)",
                   "the canary percentage must be between 0% and 100%")  # fmt: skip


def _ratio(value: str) -> float:
    return _number(value, 1, f"{value!r} is not a number between 0 and 1",
                   "the failure ratio must be between 0 and 1")  # fmt: skip


def _number(text: str, most: float, not_a_number: str, out_of_range: str) -> float:
    try:
        number = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(not_a_number) from None
    if not 0 <= number <= most:
        raise argparse.ArgumentTypeError(out_of_range)
    return number


def add_commands(sub: Any) -> argparse.ArgumentParser:
    """Register `fleet` (devices, send, deploy, desired, watch) on the top-level subparsers; returns
    its parser."""
    fleet = sub.add_parser(
        "fleet", help="manage a fleet of appliances over MQTT (devices, send, deploy, desired, watch)"
    )
    actions = fleet.add_subparsers(dest="fleet_command", required=True)

    devices = actions.add_parser("devices", help="list the fleet's devices from their retained topics")
    devices.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the broker")
    _common_flags(devices)
    devices.set_defaults(func=_guarded(_devices))

    send = actions.add_parser("send", help="send one command to one device and follow its answers")
    send.add_argument("device")
    send.add_argument("verb", choices=VERBS)
    send.add_argument("args_json", nargs="?", default="{}", help="the command's args as a JSON object")
    send.add_argument("--timeout", type=float, default=120.0, help="seconds before the command expires")
    _common_flags(send)
    _signing_flags(send)
    send.set_defaults(func=_guarded(_send))

    deploy = actions.add_parser(
        "deploy", help="staged rollout of a bundle: canary, waves, stop and roll back"
    )
    deploy.add_argument("bundle_url", help="http(s):// or file:// URL the devices download the bundle from")
    deploy.add_argument("--devices", default="all", help="all | online | ids and globs, comma separated")
    deploy.add_argument(
        "--canary", type=_percent, default=10.0, help="canary wave size, e.g. 10%% (0 = none)"
    )
    deploy.add_argument("--wave-size", type=int, default=10, help="devices per wave after the canary")
    deploy.add_argument("--pause", type=float, default=0.0, help="seconds between waves")
    deploy.add_argument(
        "--max-failure-ratio", type=_ratio, default=0.0, help="stop when failed/tried goes over this (0..1)"
    )
    deploy.add_argument("--sha256", help="the bundle's SHA-256 (64 hex digits)")
    deploy.add_argument("--timeout", type=float, default=600.0, help="per-device install timeout (s)")
    deploy.add_argument("--include-offline", action="store_true", help="send to offline devices as well")
    _common_flags(deploy)
    _signing_flags(deploy)
    deploy.set_defaults(func=_guarded(_deploy))

    desired = actions.add_parser("desired", help="publish a device's desired state (signed, retained)")
    desired.add_argument("device")
    desired.add_argument("state_json", help='{"generation": N, "bundle": {"url": "...", "sha256": "..."}}')
    _common_flags(desired)
    _signing_flags(desired)
    desired.set_defaults(func=_guarded(_desired))

    watch = actions.add_parser("watch", help="print the fleet's state/health/events/reported messages")
    watch.add_argument("--seconds", type=float, default=None, help="stop after this many seconds")
    _common_flags(watch)
    watch.set_defaults(func=_guarded(_watch))
    from edgeserve.fleet.aws_jobs_document import add_command as add_job_document

    add_job_document(actions)  # AWS IoT Jobs: the signed document, for `aws iot create-job`
    parser: argparse.ArgumentParser = fleet
    return parser


def _manager(args: argparse.Namespace) -> Any:
    from edgeserve.fleet.manager import FleetManager

    fleet = args.fleet or os.environ.get(ENV_FLEET)
    if not fleet:
        raise _UsageError(f"no fleet: give --fleet NAME or set {ENV_FLEET}")
    return FleetManager(
        args.broker or os.environ.get(ENV_BROKER) or DEFAULT_BROKER,
        fleet,
        client_id=args.client_id,
        username=args.username or os.environ.get("EDGESERVE_FLEET_USERNAME"),
        password=args.password or os.environ.get("EDGESERVE_FLEET_PASSWORD"),
        ca_file=args.ca_file,
        cert_file=args.cert_file,
        key_file=args.key_file,
        protocol=args.protocol,
        command_key=_command_key(args),
    )


def _command_key(args: argparse.Namespace) -> str | None:
    if not hasattr(args, "unsigned"):
        return None  # devices, watch: nothing is signed
    if args.unsigned:  # over $EDGESERVE_FLEET_KEY, not over an explicit --key
        if args.command_key:
            raise _UsageError("--unsigned and --key exclude each other")
        return None
    key = args.command_key or os.environ.get(ENV_KEY)
    if not key:
        raise _UsageError(
            f"no command key: give --key PATH or set {ENV_KEY} (the private key from `edgeserve keygen "
            "--role command`); --unsigned only for lab devices with [fleet] require_signed_commands = false"
        )
    return str(key)


class _UsageError(Exception):
    pass


def _out(args: argparse.Namespace, text: str, data: Any, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    print(json.dumps(data, default=str) if args.json else text, file=stream, flush=True)


def _devices(args: argparse.Namespace) -> int:
    with _manager(args) as manager:
        records = manager.devices(args.timeout)
    if args.json:
        print(json.dumps(records, default=str, indent=2))
        return 0
    if not records:
        print(f"no devices in fleet {manager.fleet} (no retained state/info under es/v1/{manager.fleet}/)")
        return 0
    rows = [("DEVICE", "ONLINE", "BUNDLE", "PREVIOUS", "HEALTH", "EDGESERVE", "SINCE")]
    for r in records:
        rows.append(
            (
                _t(r["device"], 80),
                "yes" if r["online"] else "no",
                _v(r["active_version"]),
                _v(r["previous_version"]),
                _t(r["health"] or "-", 40),
                _t(r["version"] or "-", 40),
                _t(r["since"] or "-", 40),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())
    online = sum(1 for r in records if r["online"])
    print(f"{len(records)} devices, {online} online")
    return 0


def _json_object(text: str, name: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise _UsageError(f"{name} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise _UsageError(f"{name} must be a JSON object")
    return value


def _send(args: argparse.Namespace) -> int:
    command_args = _json_object(args.args_json, "ARGS_JSON")
    with _manager(args) as manager:

        def on_update(update: dict[str, Any]) -> None:
            _out(args, f"{args.device} {args.verb}: {_describe(update)}", {"update": update})

        answer = manager.send(args.device, args.verb, command_args, args.timeout, on_update)
        if answer.get("status") == "TIMEOUT":
            _out(args, f"{args.device} {args.verb}: {_describe(answer)}", {"update": answer})
    _out(args, f"outcome: {_t(answer.get('status'), 40)}", {"outcome": answer})
    return 0 if answer.get("status") == SUCCEEDED else 1


def _desired(args: argparse.Namespace) -> int:
    state = _json_object(args.state_json, "STATE_JSON")
    with _manager(args) as manager:
        manager.set_desired(args.device, state)
    how = "signed" if manager.command_key else "UNSIGNED"
    text = f"{args.device}: desired state generation {state.get('generation')} published ({how}, retained)"
    _out(args, text, {"desired": state})
    return 0


def _deploy(args: argparse.Namespace) -> int:
    if args.wave_size < 1:
        raise _UsageError("--wave-size must be at least 1")

    def on_progress(event: dict[str, Any]) -> None:
        if args.json:
            print(json.dumps(event, default=str), flush=True)
            return
        line = _progress_line(event)
        if line is not None:
            print(line, flush=True)

    with _manager(args) as manager:
        report = manager.deploy(
            args.bundle_url,
            args.sha256,
            args.devices,
            args.canary,
            args.wave_size,
            args.pause,
            args.max_failure_ratio,
            on_progress,
            timeout_s=args.timeout,
            include_offline=args.include_offline,
        )
    if args.json:
        print(json.dumps({"report": report}, default=str), flush=True)
    return 0 if report["ok"] else 1


def _watch(args: argparse.Namespace) -> int:
    stop = threading.Event()
    lock = threading.Lock()

    def on_message(device: str, leaf: str, body: dict[str, Any], retained: bool) -> None:
        with lock:
            if args.json:
                record = {"device": device, "topic": leaf, "retained": retained, "body": body}
                print(json.dumps(record, default=str), flush=True)
            else:
                mark = " (retained)" if retained else ""
                text = _t(json.dumps(body, default=str), 4000)
                print(
                    f"{time.strftime('%H:%M:%S')} {_t(device, 80)} {_t(leaf, 40)}{mark}: {text}", flush=True
                )

    with _manager(args) as manager:
        end_watch = manager.watch(on_message)
        try:
            stop.wait(args.seconds)  # None: until Ctrl-C
        except KeyboardInterrupt:
            pass
        finally:
            end_watch()
    return 0


def _guarded(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """FleetError and usage errors are one line on stderr and exit 2; Ctrl-C is exit 130."""

    def run(args: argparse.Namespace) -> int:
        from edgeserve.fleet.manager import FleetError

        try:
            return int(command(args))
        except (FleetError, _UsageError) as exc:
            print(f"edgeserve fleet: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 130

    return run


def main(argv: list[str] | None = None) -> int:
    """`edgeserve fleet ...` on its own: argv starts after `fleet` (e.g. ["devices", "--fleet", "f"])."""
    parser = argparse.ArgumentParser(prog="edgeserve")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["fleet", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
