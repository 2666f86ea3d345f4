"""What the data plane asks of the parts below it: the repository, a served model, its scheduler.

Protocols, so that the data plane and the ensemble runner know the repository only by this shape
(the repository sits above them and hands itself in).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from tritonclient.grpc.model_config_pb2 import ModelConfig

    from edgeserve.backends.base import ModelIO
    from edgeserve.scheduling.job import Job
    from edgeserve.scheduling.stats import ModelStats


class SchedulerLike(Protocol):
    def submit(self, job: Job) -> None: ...
    def try_run_inline(self, job: Job, max_compute_ns: int) -> bool: ...


class ServedModelLike(Protocol):
    """One ready version of a model, as the repository hands it out."""

    name: str
    version: int
    config: ModelConfig
    io: ModelIO
    model_dir: Path
    platform: str
    backend_name: str
    scheduler: SchedulerLike
    stats: ModelStats


class RepositoryLike(Protocol):
    def get(self, name: str, version: str = "") -> ServedModelLike: ...
    def ready_versions(self, name: str) -> list[ServedModelLike]: ...
    def is_ready(self, name: str, version: str = "") -> bool: ...
    def all_ready(self) -> bool: ...
    def config(self, name: str, version: str = "") -> ModelConfig: ...
    def index(self, ready_only: bool = False) -> list[dict[str, str]]: ...
    def served(self) -> list[ServedModelLike]: ...
    async def load(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None: ...
    async def unload(self, name: str, unload_dependents: bool = False) -> None: ...
