"""Helpers for the repository tests: settings over a temp repository, and inference through a
served model's real scheduler."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.config import Settings
from edgeserve.repository.manager import ModelRepository
from edgeserve.scheduling.job import Job

RepoFactory = Callable[..., ModelRepository]  # the `make_repo` fixture


def make_settings(
    repo: Path, state: Path, *, load_models: list[str] | None = None, mode: str = "explicit"
) -> Settings:
    settings = Settings()
    settings.server.model_repository = repo
    settings.server.state_dir = state
    settings.server.model_control_mode = mode
    settings.server.load_models = ["*"] if load_models is None else load_models
    settings.server.exit_timeout_s = 10.0
    settings.runtime.cpu_threads = 1
    return settings


async def infer(served: Any, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One request through `served.scheduler` (what the data plane does), awaited on the loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[dict[str, np.ndarray]] = loop.create_future()

    def settle(result: Any) -> None:
        if future.done():
            return
        if isinstance(result, BaseException):
            future.set_exception(result)
        else:
            future.set_result(result)

    def done(result: Any) -> None:
        loop.call_soon_threadsafe(settle, result)

    batch = next(iter(inputs.values())).shape[0] if served.config.max_batch_size > 0 else 1
    served.scheduler.submit(Job(inputs=inputs, batch_size=batch, done=done))
    return await future


def replace_file(path: Path, data: bytes) -> None:
    """Atomic replace, as an OTA installer would do it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
