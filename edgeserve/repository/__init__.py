"""Model repository: Triton layout, config.pbtxt validation + auto-complete, version policy, lifecycle."""

from edgeserve.protocol.errors import RepositoryError

__all__ = ["RepositoryError"]
