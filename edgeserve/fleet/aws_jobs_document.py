"""`edgeserve fleet job-document`: the document of an AWS IoT job that runs one edgeserve command on some
things, each one's command signed for that device's own `es/v1/{fleet}/{thing}/cmd/{verb}` topic (the
envelope of OTA.md "Signed commands"), as `[fleet] protocol = "aws-iot-jobs"` devices read it.

    edgeserve fleet job-document deploy_bundle '{"url": "https://repo/vision-v5.esb"}' --fleet plant-7 \\
        --things cam-01,cam-02 --key /secure/keys/fleet-commands.key > deploy-v5.json
    aws iot create-job --job-id deploy-v5 --document file://deploy-v5.json --targets <thing or group ARNs>
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from edgeserve.fleet.aws_jobs import MAX_DOCUMENT_BYTES, MAX_STEP_TIMEOUT_MIN, check_thing
from edgeserve.fleet.protocol import VERBS, CommandError, Topics, check_args, utc
from edgeserve.fleet.signed import load_signing_key, sign_command


def job_document(
    verb: str,
    args: dict[str, Any],
    things: list[str],
    fleet: str,
    key: Any,
    *,
    lifetime_s: float = 3600.0,
    step_timeout_min: int | None = None,
    now: datetime | None = None,
) -> dict[str, Any]:
    """The document; ValueError names what is wrong (a verb, its arguments, a thing name, the size)."""
    if verb not in VERBS:
        raise ValueError(f"unknown verb {verb!r}; known: {', '.join(VERBS)}")
    try:
        check_args(verb, args)
    except CommandError as exc:
        raise ValueError(str(exc)) from None
    if not things:
        raise ValueError("no things: give --things NAME[,NAME...]")
    for thing in things:
        check_thing(thing)  # it is also the device id: one topic level
    if step_timeout_min is not None and not 1 <= step_timeout_min <= MAX_STEP_TIMEOUT_MIN:
        raise ValueError(f"--step-timeout-min must be 1 to {MAX_STEP_TIMEOUT_MIN}")
    private = load_signing_key(key)
    if private is None:
        raise ValueError("no command key: give --key PATH or set EDGESERVE_FLEET_KEY")
    moment = now or datetime.now(timezone.utc)
    command = json.dumps(
        {
            "cmd_id": f"job-{uuid.uuid4().hex[:16]}",
            "issued_at": utc(moment),
            "expires_at": utc(moment + timedelta(seconds=lifetime_s)),
            "args": args,
        }
    )
    commands = {
        thing: json.loads(sign_command(private, Topics(fleet, thing).cmd(verb), command)) for thing in things
    }
    section: dict[str, Any] = {"verb": verb, "commands": commands}
    if step_timeout_min is not None:
        section["step_timeout_min"] = step_timeout_min
    document = {"edgeserve": section}
    size = len(json.dumps(document).encode())
    if size > MAX_DOCUMENT_BYTES:
        per_thing = max(size // len(things), 1)
        raise ValueError(
            f"{len(things)} things make a {size}-byte document, over AWS IoT's 32 KB: split "
            f"them into jobs of at most {MAX_DOCUMENT_BYTES // per_thing - 1} things"
        )
    return document


def add_command(actions: Any) -> None:
    parser = actions.add_parser("job-document", help="an AWS IoT job document: one signed command per thing")
    parser.add_argument("verb", choices=VERBS)
    parser.add_argument("args_json", nargs="?", default="{}", help="the command's args as JSON (default {})")
    parser.add_argument(
        "--fleet",
        default=os.environ.get("EDGESERVE_FLEET_FLEET"),
        help="the devices' [fleet] fleet (or $EDGESERVE_FLEET_FLEET)",
    )
    parser.add_argument("--things", required=True, help="thing names (= device ids), comma separated")
    parser.add_argument(
        "--key",
        "--command-key",
        dest="command_key",
        default=os.environ.get("EDGESERVE_FLEET_KEY") or None,
        help="private command key (PEM), or $EDGESERVE_FLEET_KEY",
    )
    parser.add_argument(
        "--lifetime",
        type=float,
        default=3600.0,
        help="seconds the command stays valid (expires_at - issued_at; default 3600)",
    )
    parser.add_argument("--step-timeout-min", type=int, help="each install step must report within this")
    parser.add_argument("--out", type=Path, help="write here instead of stdout")
    parser.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    try:
        if not args.fleet:
            raise ValueError("no fleet: give --fleet NAME or set EDGESERVE_FLEET_FLEET")
        command_args = json.loads(args.args_json)
        if not isinstance(command_args, dict):
            raise ValueError("ARGS_JSON must be a JSON object")
        things = [t.strip() for t in args.things.split(",") if t.strip()]
        document = job_document(
            args.verb,
            command_args,
            things,
            args.fleet,
            args.command_key,
            lifetime_s=args.lifetime,
            step_timeout_min=args.step_timeout_min,
        )
    except ValueError as exc:  # json's errors are ValueErrors too
        print(f"edgeserve fleet job-document: {exc}", file=sys.stderr)
        return 2
    text = json.dumps(document, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0
