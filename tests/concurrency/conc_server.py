"""A real `edgeserve serve` over a repository of the suite's models (tests and the soak benchmark),
and the seeds a round runs with."""

from __future__ import annotations

import os
from pathlib import Path

from conc_models import Repository
from conc_transports import Endpoints
from es_server import RunningServer, start_server

SEEDS_ENV = "EDGESERVE_CONC_SEEDS"  # "7" or "7,8": replay these seeds instead of the default ones
SERVER_ENV = {
    "EDGESERVE_RUNTIME_RACE_BUDGET_S": "0",  # the config's backend, no load-time race
    "EDGESERVE_SERVER_CACHE_MB": "8",
}


def seeds(default: tuple[int, ...]) -> list[int]:
    raw = os.environ.get(SEEDS_ENV, "").strip()
    if not raw:
        return list(default)
    return [int(s) for s in raw.replace(",", " ").split()]


def endpoints(server: RunningServer) -> Endpoints:
    return Endpoints(server.http_url, server.grpc_url, server.zmq_endpoint)


def start(repo: Repository, tmp: Path, extra_env: dict[str, str] | None = None) -> RunningServer:
    repo.write()
    return start_server(repo.root, tmp, env={**SERVER_ENV, **(extra_env or {})}, timeout=240.0)
