"""Model repository: Triton layout, config.pbtxt parsing + auto-complete, version policy, lifecycle."""

from edgeserve.repository.errors import RepositoryError

__all__ = ["RepositoryError"]
