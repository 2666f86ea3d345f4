"""What the fleet agent may ask of the device, and how each verb maps onto it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from edgeserve.fleet.protocol import Command

Report = Callable[[str, float | None, str], None]


class FleetCommandFailed(Exception):
    """A command ran and failed: FAILED with this message."""


class DeviceServices(Protocol):
    """What the agent may ask of the device (the supervisor implements it)."""

    def install(
        self, url: str, sha256: str | None, report: Report, cancel: threading.Event
    ) -> dict[str, Any]: ...
    def rollback(self, to_version: int, report: Report) -> dict[str, Any]: ...
    def set_model(self, model: str, active: bool) -> dict[str, Any]: ...
    def set_config(self, changes: dict[str, dict[str, Any]]) -> dict[str, Any]: ...
    def restart_runtime(self) -> dict[str, Any]: ...
    def gc(self) -> dict[str, Any]: ...
    def revoke_key(self, key_id: str, role: str, cmd_id: str) -> dict[str, Any]: ...
    def status(self) -> dict[str, Any]: ...
    def info(self) -> dict[str, Any]: ...
    def health(self) -> dict[str, Any]: ...
    def metrics(self) -> dict[str, Any]: ...


def execute(
    command: Command,
    services: DeviceServices,
    report: Report,
    cancel: threading.Event,
    *,
    cancel_command: Callable[[str], dict[str, Any]],
    agent_status: Callable[[], dict[str, Any]],
) -> dict[str, Any]:
    """Run one verb; FleetCommandFailed (or any exception) means FAILED."""
    args = command.args
    if command.verb == "deploy_bundle":
        return services.install(args["url"], args.get("sha256"), report, cancel)
    if command.verb == "rollback":
        return services.rollback(int(args["to_version"]), report)
    if command.verb in ("activate_model", "deactivate_model"):
        return services.set_model(str(args["model"]), command.verb == "activate_model")
    if command.verb == "set_config":
        return services.set_config(args)
    if command.verb == "restart_runtime":
        return services.restart_runtime()
    if command.verb == "gc":
        return services.gc()
    if command.verb == "get_status":
        return {**services.status(), "agent": agent_status()}
    if command.verb == "cancel":
        return cancel_command(str(args["cmd_id"]))
    if command.verb == "revoke_key":
        return services.revoke_key(str(args["key_id"]), str(args["role"]), command.cmd_id)
    raise FleetCommandFailed(f"verb {command.verb} is not handled")  # pragma: no cover
