"""Fixtures for the repository tests: repositories over temp folders, closed after each test."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from repo_helpers import RepoFactory, make_settings

from edgeserve.repository.manager import ModelRepository


@pytest.fixture
async def make_repo(tmp_path: Path) -> AsyncIterator[RepoFactory]:
    """`make_repo(repo_dir, **settings_kwargs)` -> a ModelRepository closed after the test."""
    made: list[ModelRepository] = []

    def factory(repo: Path, selector: Any = None, **kwargs: Any) -> ModelRepository:
        repository = ModelRepository(make_settings(repo, tmp_path / "state", **kwargs), selector=selector)
        made.append(repository)
        return repository

    yield factory
    for repository in made:
        await repository.close()
