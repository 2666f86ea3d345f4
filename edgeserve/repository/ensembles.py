"""The repository's side of ensembles: build one (validated against its loaded step models), load
its composing models first, order start-up loads, and tell whether it can serve now.

An ensemble serves only while every composing model does: unloading one makes the ensemble
UNAVAILABLE (its index entry says which model), and loading it again makes the ensemble serve again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from edgeserve.backends.base import ModelIO, TensorSpec
from edgeserve.protocol.errors import InferenceError, invalid_arg
from edgeserve.repository.config import parse_pbtxt, validate
from edgeserve.repository.layout import CONFIG_FILE
from edgeserve.repository.served import ServedModel
from edgeserve.server import validation
from edgeserve.server.ensemble import EnsembleScheduler, EnsembleStats, LoadOnDemand, Resolver
from edgeserve.server.ensemble_graph import ENSEMBLE_PLATFORM, build_plan, composing_models, is_ensemble

if TYPE_CHECKING:
    import asyncio

# The ensembles whose load is in progress in this task's chain (nested ensembles): an ensemble that
# reaches itself again is a cycle, refused instead of waiting on its own lock.
LOADING_CHAIN: ContextVar[tuple[str, ...]] = ContextVar("edgeserve_ensemble_chain", default=())


class _Locked(Protocol):
    lock: asyncio.Lock


class _Loader(Protocol):
    def folders(self) -> dict[str, Path]: ...
    def is_ready(self, name: str, version: str = "") -> bool: ...
    async def load(self, name: str, config_json: str | None = None,
                   files: dict[str, bytes] | None = None) -> None: ...  # fmt: skip


def folder_is_ensemble(folder: Path) -> bool:
    """Whether `<folder>/config.pbtxt` declares an ensemble (a broken config is not: its load says so)."""
    path = folder / CONFIG_FILE
    if not path.is_file():
        return False
    try:
        return is_ensemble(parse_pbtxt(path))
    except InferenceError:
        return False


def in_folders(names: Iterable[str], folders: Mapping[str, Path]) -> list[str]:
    """The ensembles among `names` (start-up loads them after the models they compose)."""
    return [n for n in names if n in folders and folder_is_ensemble(folders[n])]


async def load_composing(repository: _Loader, models: Mapping[str, _Locked], name: str,
                         raw_config: Any) -> None:  # fmt: skip
    """Load the models an ensemble's steps run (Triton's explicit mode), each unless it serves
    already or is loading now (then waited for); one that is not in the repository is left to the
    ensemble's validation to report (with the file and field)."""
    chain = (*LOADING_CHAIN.get(), name)
    token = LOADING_CHAIN.set(chain)
    try:
        for step in composing_models(raw_config):
            if step in chain:
                raise invalid_arg(f"failed to load '{name}': ensembles form a cycle: "
                                  f"{' -> '.join((*chain, step))}")  # fmt: skip
            other = models.get(step)
            if other is not None and other.lock.locked():
                async with other.lock:  # being loaded (at start, or by a client): wait for it
                    pass
            if repository.is_ready(step) or (other is None and step not in repository.folders()):
                continue
            try:
                await repository.load(step)
            except InferenceError as exc:
                raise InferenceError(exc.status, f"failed to load '{name}': composing model '{step}' "
                                     f"failed: {exc.message}") from None  # fmt: skip
    finally:
        LOADING_CHAIN.reset(token)


def dependents(served: Mapping[str, Mapping[int, ServedModel]], name: str) -> list[str]:
    """The loaded ensembles that have a step running `name`."""
    return sorted({s.name for versions in served.values() for s in versions.values()
                   if any(model == name for model, _ in s.depends_on)})  # fmt: skip


def dependency_problem(served: ServedModel, is_ready: Callable[[str, str], bool],
                       on_demand: Callable[[str], bool] | None = None) -> str | None:  # fmt: skip
    """Why an ensemble cannot serve now (a composing model not ready, and not one that its next
    request loads: load on first use, or unloaded for the memory budget), or None."""
    for model, version in served.depends_on:
        if not is_ready(model, version) and not (on_demand is not None and on_demand(model)):
            which = f"version {version} of " if version else ""
            return (f"ensemble '{served.name}' is not ready: {which}composing model '{model}' is not "
                    "ready; load it to serve the ensemble again")  # fmt: skip
    return None


def build_ensemble(name: str, model_dir: Path, version: int, raw_config: Any, where: str,
                   resolve: Resolver, touch: Callable[[str], None] | None = None,
                   load_on_demand: LoadOnDemand | None = None) -> ServedModel:  # fmt: skip
    """Validate an ensemble config against its loaded step models and serve it (event loop thread).
    `touch` marks a step model used (memory-budget LRU); `load_on_demand` loads a step model that
    loads on first use or was unloaded for the budget (the repository's, as the data plane uses)."""
    from tritonclient.grpc import model_config_pb2 as mc

    config = mc.ModelConfig()
    config.CopyFrom(raw_config)
    config.name = config.name or name
    validate(config, where, name, model_dir)

    def lookup(model: str, wanted: str) -> Any:
        try:
            return resolve(model, wanted).config
        except InferenceError:
            return None

    plan = build_plan(config, where, name, lookup)
    stats = EnsembleStats(name, version, plan)
    batch = (-1,) if config.max_batch_size > 0 else ()

    def specs(tensors: Any) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(t.name, validation.config_datatype(t.data_type), (*batch, *t.dims))
                     for t in tensors)  # fmt: skip

    return ServedModel(
        name=name, version=version, config=config, io=ModelIO(specs(config.input), specs(config.output)),
        model_dir=model_dir, platform=ENSEMBLE_PLATFORM, backend_name=ENSEMBLE_PLATFORM,
        scheduler=EnsembleScheduler(plan, config, stats, resolve, touch, load_on_demand), stats=stats,
        depends_on=tuple(dict.fromkeys((s.model_name, s.model_version) for s in plan.steps)),
        choice_reason="ensemble: its steps run on their own models' schedulers",
    )  # fmt: skip
