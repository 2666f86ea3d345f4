"""Which agent carries the fleet's commands: the es/v1 MQTT surface (`[fleet] protocol` 5 or 3.1.1) or
AWS IoT Jobs (`aws-iot-jobs`). Both run the same signed commands on the same DeviceServices."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from edgeserve.config import FleetSection
from edgeserve.fleet.services import DeviceServices
from edgeserve.ota.trust import TrustStore, default_trust_dir


class Agent(Protocol):
    def start(self) -> None: ...
    def stop(self) -> None: ...
    def state_changed(self) -> None: ...


def make_agent(
    settings: FleetSection,
    state_dir: Path,
    services: DeviceServices,
    version: str,
    trust: TrustStore | None = None,
) -> Agent:
    """The agent for `[fleet] protocol`; ImportError when paho-mqtt (the `fleet` extra) is missing.
    `trust`: the device's trust store (command keys, revocations); default `<state_dir>/trust`."""
    trust = trust or TrustStore(default_trust_dir(state_dir), state_dir)
    if settings.protocol == "aws-iot-jobs":
        from edgeserve.fleet.aws_jobs_agent import JobsAgent

        return JobsAgent(settings, state_dir, services, version, trust)
    from edgeserve.fleet.agent import FleetAgent

    return FleetAgent(settings, state_dir, services, version, trust)
