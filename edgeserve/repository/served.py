"""One loaded model version (`ServedModel`) and the blocking work that builds it.

`prepare_version` runs in a worker thread: choose a backend, read the model's signature, complete
and validate the config, load one backend instance per instance_group count and warm every
instance up. Only then does the manager put a scheduler in front of it and make it READY.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from edgeserve.backends.base import Instance, ModelIO, get_backend
from edgeserve.backends.options import DEFAULT_HANG_TIMEOUT_S
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository import autocomplete, warmup
from edgeserve.repository.config import validate
from edgeserve.repository.origin import Origin, Provenance, check_paths
from edgeserve.repository.selection import BackendChoice, BackendSelector

if TYPE_CHECKING:
    from edgeserve.scheduling.scheduler import Scheduler
    from edgeserve.scheduling.stats import ModelStats
    from edgeserve.server.contracts import SchedulerLike

log = logging.getLogger("edgeserve.repository")


@dataclass(eq=False)
class ServedModel:
    """A READY model version, as the data plane sees it (`ServedModelLike`)."""

    name: str
    version: int
    config: Any  # the completed ModelConfig
    io: ModelIO
    model_dir: Path
    platform: str
    backend_name: str
    # Typed as the data plane's protocol (its attribute types must match exactly); the repository
    # puts a `Scheduler` here, see `managed_scheduler`.
    scheduler: SchedulerLike
    stats: ModelStats
    instances: list[Instance] = field(default_factory=list)
    model_path: Path | None = None
    choice_reason: str = ""
    fallback_reason: str | None = None  # an instance runs on less than was asked for (CPU fallback)
    load_seconds: float = 0.0
    # An ensemble: the (model, version "" = latest) its steps run; it serves only while they all do.
    depends_on: tuple[tuple[str, str], ...] = ()
    origin: str = "local"  # where its files and config came from (repository/origin.py Origin)

    @property
    def managed_scheduler(self) -> Scheduler:
        return cast("Scheduler", self.scheduler)


@dataclass
class PreparedVersion:
    """A loaded and warmed-up version, not yet scheduled."""

    version: int
    config: Any
    io: ModelIO
    choice: BackendChoice
    instances: list[Instance]
    fallback_reason: str | None = None
    notes: list[str] = field(default_factory=list)  # backends tried before this one, and why they failed
    origin: str = "local"


def close_instances(instances: list[Instance], label: str) -> None:
    for instance in instances:
        try:
            instance.close()
        except Exception:
            log.exception("%s: closing an instance failed", label)


def _prepare_with(
    choice: BackendChoice, name: str, model_dir: Path, version: int, raw_config: Any, where: str,
    default_max_batch_size: int,
) -> PreparedVersion:  # fmt: skip
    backend = get_backend(choice.backend_name)
    inspect_config = getattr(backend, "inspect_config", None)
    if inspect_config is not None:  # the signature is in the config (Python models' auto_complete_config)
        io, raw_config = inspect_config(choice.model_path, raw_config, where, choice.options)
    else:
        io = backend.inspect(choice.model_path)
    config = autocomplete.complete(
        raw_config, io, model_name=name, backend_name=backend.name,
        platform=backend.platforms[0] if backend.platforms else "", model_file=choice.model_path.name,
        default_max_batch_size=max(default_max_batch_size, choice.batch),
        gpu=choice.options.device.upper().startswith("GPU"), where=where,
        preferred_batch_size=choice.batch,  # measured by the race where the config leaves it open
    )  # fmt: skip
    validate(config, where, name, model_dir)
    check_paths(config, where, model_dir)  # again: the model's auto_complete_config may have named files
    if choice.instances > 0 and len(config.instance_group) == 1:
        config.instance_group[0].count = choice.instances  # measured by the load-time race
    for key, value in choice.shown.items():
        config.parameters[key].string_value = value
    label = f"model {name} version {version}"
    instances: list[Instance] = []
    try:
        for _ in range(autocomplete.instance_count(config)):
            instances.append(backend.load(choice.model_path, config, choice.options))
        warmup.run(instances, warmup.samples(config, model_dir, where), where)
    except BaseException:
        close_instances(instances, label)
        raise
    fallbacks = {getattr(i, "fallback_reason", None) for i in instances} - {None}
    _record_tuning(instances, config, label)
    return PreparedVersion(
        version, config, io, choice, instances, "; ".join(sorted(map(str, fallbacks))) or None
    )


def _record_tuning(instances: list[Instance], config: Any, label: str) -> None:
    """Log what a backend measured at load, and show its choice in the served config's parameters
    (as Triton's auto-complete fills in what it decided) when every instance chose the same."""
    for note in {getattr(i, "threads_note", None) for i in instances} - {None}:
        log.info("%s: %s", label, note)
    tuned = [dict(getattr(i, "tuned_parameters", None) or {}) for i in instances]
    if tuned and tuned[0] and all(t == tuned[0] for t in tuned):
        for key, value in tuned[0].items():
            config.parameters[key].string_value = value


def prepare_version(
    selector: BackendSelector, name: str, model_dir: Path, version: int, version_dir: Path, raw_config: Any,
    where: str, default_max_batch_size: int, provenance: Provenance | None = None,
) -> PreparedVersion:  # fmt: skip
    """Blocking: load + warm up one version; tries the choice's fallbacks when a backend fails.
    `provenance` (origin.py) is checked before the selector (whose race runs backends) reads the folder."""
    provenance = provenance or Provenance(name, Origin.LOCAL, where)
    provenance.check_version(version, version_dir, raw_config)
    choice = provenance.check_choice(selector.choose(name, model_dir, version_dir, raw_config), version_dir)
    attempts = [choice, *choice.fallbacks]
    failures: list[tuple[BackendChoice, InferenceError]] = []
    for attempt in attempts:
        try:
            prepared = _prepare_with(
                attempt, name, model_dir, version, raw_config, where, default_max_batch_size
            )
        except InferenceError as exc:
            failures.append((attempt, exc))
            continue
        except Exception as exc:  # a runtime bug must not take the server down
            log.exception("model %s version %d: backend %s raised", name, version, attempt.backend_name)
            failures.append((attempt, InferenceError(Status.INTERNAL, f"{attempt.backend_name}: {exc}")))
            continue
        for failed, error in failures:
            note = (
                f"backend {failed.backend_name} failed ({error.message}); fell back to {attempt.backend_name}"
            )
            log.warning("model %s version %d: %s", name, version, note)
            prepared.notes.append(note)
        prepared.origin = provenance.origin.value
        return prepared
    first = failures[0][1]
    if len(failures) == 1:
        raise first
    tried = "; ".join(f"{c.backend_name}: {e.message}" for c, e in failures)
    raise InferenceError(first.status, f"no backend could load it ({tried})")


def hang_timeout_s(config: Any, where: str) -> float:
    """The model config's `parameters { key: "hang_timeout_s" }`, else the scheduler's default."""
    if "hang_timeout_s" not in config.parameters:
        return DEFAULT_HANG_TIMEOUT_S
    text = config.parameters["hang_timeout_s"].string_value
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InferenceError(
            Status.INVALID_ARG,
            f"{where}: parameters.hang_timeout_s '{text}' must be 0 (never) or a number of seconds",
        )
    return value


def build_served(name: str, model_dir: Path, prepared: PreparedVersion, seconds: float) -> ServedModel:
    """Put a started scheduler in front of a prepared version (call on the event loop thread)."""
    from edgeserve.scheduling.scheduler import Scheduler
    from edgeserve.scheduling.stats import ModelStats

    config = prepared.config
    stats = ModelStats(name, prepared.version)
    choice = prepared.choice
    where = str(model_dir / "config.pbtxt")

    def replacement() -> Instance:
        """A fresh instance for one the scheduler found hung: loaded and warmed up as at load."""
        instance = get_backend(choice.backend_name).load(choice.model_path, config, choice.options)
        try:
            warmup.run([instance], warmup.samples(config, model_dir, where), where)
        except BaseException:
            close_instances([instance], f"model {name} version {prepared.version}")
            raise
        return instance

    try:
        hang_s = hang_timeout_s(config, where)
        if config.WhichOneof("scheduling_choice") == "sequence_batching":
            from edgeserve.scheduling.sequence import SequenceBatcher

            scheduler: Any = SequenceBatcher(name, prepared.version, config, prepared.instances, stats,
                                             model_dir=model_dir, hang_timeout_s=hang_s,
                                             instance_factory=replacement)  # fmt: skip
        else:
            scheduler = Scheduler(name, prepared.version, config, prepared.instances, stats,
                                  hang_timeout_s=hang_s, instance_factory=replacement)  # fmt: skip
        scheduler.start()
    except BaseException:
        close_instances(prepared.instances, f"model {name} version {prepared.version}")
        raise
    return ServedModel(
        name=name, version=prepared.version, config=config, io=prepared.io, model_dir=model_dir,
        platform=config.platform or config.backend, backend_name=prepared.choice.backend_name,
        scheduler=scheduler, stats=stats, instances=prepared.instances, model_path=prepared.choice.model_path,
        choice_reason=prepared.choice.reason, fallback_reason=prepared.fallback_reason, load_seconds=seconds,
        origin=prepared.origin,
    )  # fmt: skip
