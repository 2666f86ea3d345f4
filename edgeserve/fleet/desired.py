"""The retained `desired` state, checked before the agent acts on it.

`generation` is an integer from 0 to 2**53-1 (what every JSON implementation holds exactly); a bool,
a float, a string or anything larger is refused, so one message cannot pin a device above every
generation the manager will ever send. A replay cannot move a device either: a generation at or below
the applied one is ignored, and an old bundle a replayed (or reset device's) desired state names is
refused by the installer's monotonic bundle versions. The bundle is checked as `deploy_bundle` checks
its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from edgeserve.fleet.jsonlimits import JsonRefused, loads
from edgeserve.fleet.protocol import MAX_PAYLOAD_BYTES, CommandError, check_args
from edgeserve.logs import safe

MAX_GENERATION = 2**53 - 1


class DesiredRefused(ValueError):
    """A desired state the agent does not act on (reported as `desired_rejected`)."""


@dataclass(frozen=True)
class Desired:
    generation: int
    url: str | None  # None: nothing to deploy (the generation is still recorded)
    sha256: str | None


def parse_desired(payload: bytes) -> Desired | None:
    """The desired state; None for an empty (cleared) retained message; DesiredRefused says why not."""
    if not payload:
        return None
    try:
        data = loads(payload, max_bytes=MAX_PAYLOAD_BYTES)
    except JsonRefused as exc:
        raise DesiredRefused(f"desired state is not UTF-8 JSON within limits: {exc}") from None
    if not isinstance(data, dict):
        raise DesiredRefused("desired state must be a JSON object {generation, bundle}")
    generation = data.get("generation")
    if type(generation) is not int or not 0 <= generation <= MAX_GENERATION:
        raise DesiredRefused(
            f"desired generation {safe(repr(generation), 40)} is not an integer from 0 to {MAX_GENERATION}"
        )
    bundle = data.get("bundle")
    if not isinstance(bundle, dict) or not isinstance(bundle.get("url"), str):
        return Desired(generation, None, None)
    args = {"url": bundle["url"], "sha256": bundle.get("sha256")}
    try:
        check_args("deploy_bundle", args)
    except CommandError as exc:
        raise DesiredRefused(f"desired bundle: {exc}") from None
    return Desired(generation, args["url"], args["sha256"])
