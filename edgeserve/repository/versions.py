"""Version policy: which of a model's version folders are served (Triton's ModelVersionPolicy)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def select_versions(available: Iterable[int], config: Any) -> tuple[list[int], list[int]]:
    """(versions to serve, ascending; versions the policy names that have no folder).

    Unset policy = latest{num_versions: 1}.
    """
    present = sorted(set(available))
    policy = config.version_policy if config.HasField("version_policy") else None
    which = policy.WhichOneof("policy_choice") if policy is not None else None
    if which == "all":
        return present, []
    if which == "specific":
        wanted = sorted(set(int(v) for v in policy.specific.versions))  # type: ignore[union-attr]
        return [v for v in wanted if v in present], [v for v in wanted if v not in present]
    count = int(policy.latest.num_versions) if which == "latest" else 1  # type: ignore[union-attr]
    return present[-max(count, 1) :] if present else [], []


def describe(config: Any) -> str:
    """A short text of the policy for logs: "latest 1", "all", "specific [1, 3]"."""
    if not config.HasField("version_policy"):
        return "latest 1"
    policy = config.version_policy
    which = policy.WhichOneof("policy_choice")
    if which == "all":
        return "all"
    if which == "specific":
        return f"specific {sorted(int(v) for v in policy.specific.versions)}"
    return f"latest {policy.latest.num_versions if which == 'latest' else 1}"
