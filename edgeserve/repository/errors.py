"""Repository errors: an InferenceError whose message names the file, the field and what is wrong."""

from __future__ import annotations

from edgeserve.protocol.errors import InferenceError, Status


class RepositoryError(InferenceError):
    """`<file>: <field>: <what is wrong>`; INVALID_ARG unless a status is given."""

    def __init__(self, where: str, field: str, problem: str, status: Status = Status.INVALID_ARG) -> None:
        message = f"{where}: {field}: {problem}" if field else f"{where}: {problem}"
        super().__init__(status, message)
        self.where = where
        self.field = field
        self.problem = problem
