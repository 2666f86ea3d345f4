"""What every scheduler of one model version holds: the stateless Scheduler and the SequenceBatcher."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.scheduling.stats import ModelStats

if TYPE_CHECKING:
    from edgeserve.backends.base import Instance


class ModelVersionScheduler:
    """A mixin: `_init_version` at the top of the scheduler's __init__."""

    def _init_version(
        self, model_name: str, version: int, config: Any, instances: list[Instance], stats: ModelStats
    ) -> None:
        if not instances:
            raise InferenceError(Status.INTERNAL, f"model '{model_name}' version {version} has no instances")
        self.model_name = model_name
        self.version = int(version)
        self.config = config
        self.stats = stats
        self._instances = list(instances)

    @property
    def instance_count(self) -> int:
        return len(self._instances)
