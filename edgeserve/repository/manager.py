"""`ModelRepository`: versions, load / reload / unload with no loss of availability, and the index.

Loading (backend load + warm-up) runs in worker threads so the server keeps answering. A (re)load
builds the whole new version set beside the old one, swaps the served map in one assignment, then
drains and closes the old versions. A failed reload keeps the old versions serving. Loads and
unloads of one model are serialised by a per-model lock; different models load in parallel (at
most `LOAD_PARALLELISM` at a time, to bound peak memory and CPU on small boxes).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import model_config_pb2 as mc

from edgeserve.config import Settings
from edgeserve.protocol.errors import InferenceError, Status, internal, invalid_arg, not_found, unavailable
from edgeserve.repository import bundle_files, ensembles, origin, overrides, request_files
from edgeserve.repository.budget import MemoryBudget
from edgeserve.repository.config import parse_override, parse_pbtxt
from edgeserve.repository.layout import (
    CONFIG_FILE,
    DEFAULT_FILENAMES,
    active_models,
    check_model_name,
    is_version_name,
    list_models,
    version_dirs,
)
from edgeserve.repository.selection import BackendSelector, DefaultSelector
from edgeserve.repository.served import ServedModel, build_served, close_instances, prepare_version
from edgeserve.repository.versions import describe, select_versions
from edgeserve.server.ensemble_graph import is_ensemble

if TYPE_CHECKING:
    from edgeserve.server.contracts import RepositoryLike, ServedModelLike

log = logging.getLogger("edgeserve.repository")

READY, UNAVAILABLE, LOADING, UNLOADING = "READY", "UNAVAILABLE", "LOADING", "UNLOADING"
LOAD_PARALLELISM = 2


@dataclass
class _VersionState:
    state: str
    reason: str = ""


@dataclass
class _Model:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    states: dict[int, _VersionState] = field(default_factory=dict)
    error: str = ""  # a model-level failure (bad config, no versions) while nothing serves
    wanted: bool = False  # asked to be loaded (start or load API) and not unloaded since
    override_dirs: list[Path] = field(default_factory=list)


class ModelRepository:
    def __init__(self, settings: Settings, selector: BackendSelector | None = None) -> None:
        self.settings = settings
        self.root = Path(settings.server.model_repository)
        self.selector: BackendSelector = selector or DefaultSelector(settings)
        self._served: dict[
            str, dict[int, ServedModel]
        ] = {}  # name -> ready versions; replaced, never mutated
        self._models: dict[str, _Model] = {}
        self._slots: asyncio.Semaphore | None = None
        self._started = False
        self._closing = False
        self.budget = MemoryBudget(self)  # memory budget, LRU eviction, load on first use, autoscale
        self.load_on_demand = self.budget.load_on_demand
        self.touch = self.budget.residency.touch  # the data plane marks a model used (LRU)

    # -- lookups (event loop thread; no awaits, so each sees one consistent served map) ------------
    def get(self, name: str, version: str = "") -> ServedModel:
        versions = self._served.get(name)
        model = self._models.get(name)
        if version:
            try:
                number = int(version)
            except ValueError:
                raise invalid_arg(
                    f"Request for unknown model: '{name}' version '{version}' is not a number"
                ) from None
            if versions and number in versions:
                return self._serving(versions[number])
            if model is not None and number in model.states:
                raise unavailable(
                    f"Request for unknown model: '{name}' version {number} is not at ready state"
                )
            if model is None:
                raise not_found(f"Request for unknown model: '{name}' is not found")
            raise not_found(f"Request for unknown model: '{name}' version {number} is not found")
        if versions:
            return self._serving(versions[max(versions)])
        if model is not None:
            raise unavailable(f"Request for unknown model: '{name}' has no available versions")
        raise not_found(f"Request for unknown model: '{name}' is not found")

    def _serving(self, served: ServedModel) -> ServedModel:
        """`served`, unless it is an ensemble one of whose composing models does not serve now."""
        if served.depends_on:
            problem = ensembles.dependency_problem(served, self.is_ready, self.budget.residency.on_demand)
            if problem is not None:
                raise unavailable(problem)
        return served

    def ready_versions(self, name: str) -> list[ServedModelLike]:
        versions = self._served.get(name, {})
        return [versions[v] for v in sorted(versions)]

    def is_ready(self, name: str, version: str = "") -> bool:
        try:
            self.get(name, version)
        except InferenceError:
            return False
        return True

    def all_ready(self) -> bool:
        """Triton's strict readiness: started, and every model asked for serves at least one version."""
        if not self._started or self._closing:
            return False
        return all(self.is_ready(name) for name, model in self._models.items() if model.wanted)

    def config(self, name: str, version: str = "") -> Any:
        return self.get(name, version).config

    def served(self) -> list[ServedModelLike]:
        return [m for name in sorted(self._served) for m in self.ready_versions(name)]

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Every model in the repository or loaded from a request: one entry per known version;
        models never loaded have an entry with empty version and state (as Triton)."""
        entries: list[dict[str, str]] = []
        for name in sorted(set(self.folders()) | set(self._models)):
            model = self._models.get(name)
            states = dict(model.states) if model is not None else {}
            if not states:
                if ready_only:
                    continue
                error = model.error if model is not None else ""
                state, error = self.budget.reason(name, UNAVAILABLE if error else "", error)
                entries.append({"name": name, "version": "", "state": state, "reason": error})
                continue
            error = model.error if model is not None else ""
            for version in sorted(states):
                status = states[version]
                if ready_only and status.state != READY:
                    continue
                reason = error if error and status.state == UNAVAILABLE else status.reason
                served = self._served.get(name, {}).get(version)
                if status.state == READY and served is not None and served.depends_on:
                    problem = ensembles.dependency_problem(
                        served, self.is_ready, self.budget.residency.on_demand
                    )
                    if problem is not None:
                        if ready_only:
                            continue
                        status = _VersionState(UNAVAILABLE, problem)
                        reason = problem
                _, reason = self.budget.reason(name, status.state, reason)
                entries.append({"name": name, "version": str(version), "state": status.state,
                                "reason": reason})  # fmt: skip
        return entries

    # -- where models come from: the model repository, then the active OTA bundle ------------------
    def folders(self) -> dict[str, Path]:
        """Model name -> folder. The bundle is resolved at each call: after a switch, a (re)load reads
        the new bundle, and everything loaded at one start comes from one bundle, never a mix."""
        found = {name: self.root / name for name in list_models(self.root)} if self.root.is_dir() else {}
        bundle = active_models(self.settings.server.state_dir)
        if bundle is not None:
            for name in list_models(bundle):
                found.setdefault(name, bundle / name)
        return found

    def clashes(self) -> dict[str, str]:
        """Names in both the model repository and the active bundle (refused: which one is meant?)."""
        bundle = active_models(self.settings.server.state_dir)
        if bundle is None or not self.root.is_dir():
            return {}
        both = set(list_models(self.root)) & set(list_models(bundle))
        return {
            name: f"model '{name}' is both in the model repository {self.root} and in the active bundle "
            f"{bundle.parent.name}; remove one of them"
            for name in sorted(both)
        }

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the startup models (all of them, or `load_models`); failures are logged and shown in
        the index, never raised, so one broken model does not keep the others down."""
        server = self.settings.server
        if not self.root.is_dir() and active_models(server.state_dir) is None:
            log.error(
                "model repository %s does not exist; serving no models until some are loaded", self.root
            )
        if server.model_control_mode == "none" or "*" in server.load_models:
            names = list(self.folders())
        else:
            names = list(dict.fromkeys(server.load_models))
        await asyncio.to_thread(overrides.sweep, server.state_dir)  # what a killed load wrote
        names = self.budget.startup(names)  # less the load-on-first-use models
        log.info("loading %d model(s) from %s: %s", len(names), self.root, ", ".join(names) or "(none)")
        later = ensembles.in_folders(names, self.folders())  # loaded after the models they compose
        await asyncio.gather(*(self._load_quietly(name) for name in names if name not in later))
        await asyncio.gather(*(self._load_quietly(name) for name in later))
        self._started = True

    async def _load_quietly(self, name: str) -> None:
        try:
            await self.load(name)
        except InferenceError:
            pass  # logged and recorded by load()
        except Exception:
            log.exception("model %s: unexpected error while loading", name)

    async def close(self) -> None:
        """Refuse new loads, then drain and unload every model."""
        self._closing = True
        await self.budget.close()
        await asyncio.gather(*(self._unload_quietly(name) for name in list(self._models)))
        overrides.release(self.settings.server.state_dir)

    async def _unload_quietly(self, name: str) -> None:
        try:
            await self.unload(name)
        except Exception:
            log.exception("model %s: unloading failed", name)

    # -- load / unload -----------------------------------------------------------------------------
    async def load(
        self, name: str, config_json: str | None = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load or reload `name`. `config_json`: Triton model-config JSON (config.pbtxt text is
        accepted too) used instead of the folder's config.pbtxt. `files`: "1/model.onnx" (the
        "file:" prefix is optional) -> bytes; the model is then served from those files only."""
        check_model_name(name)
        if self._closing:
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        model = self._models.setdefault(name, _Model())
        async with model.lock:
            model.wanted = True
            try:
                await self._load_locked(name, model, config_json or None, files or None)
            except InferenceError as exc:
                if not self._served.get(name):
                    model.error = exc.message
                raise

    async def _load_locked(self, name: str, model: _Model, config_json: str | None,
                           files: dict[str, bytes] | None) -> None:  # fmt: skip
        try:
            source, raw_config, where, trust = await asyncio.to_thread(self._source, name, config_json, files)
        except InferenceError as exc:
            log.error("model %s failed: %s", name, exc.message)
            raise
        if files:
            model.override_dirs.append(source)
        if is_ensemble(raw_config):
            try:
                await ensembles.load_composing(self, self._models, name, raw_config)
            except InferenceError as exc:
                log.error("model %s failed: %s", name, exc.message)
                self._forget_override(model, source)
                raise
        available = version_dirs(source)
        chosen, missing = select_versions(available, raw_config)
        if not chosen:
            found = ", ".join(map(str, sorted(available))) or "none"
            error = InferenceError(Status.NOT_FOUND, f"{source}: no version folder matches version policy "
                                   f"{describe(raw_config)} (version folders: {found})")  # fmt: skip
            log.error("model %s failed: %s", name, error.message)
            self._forget_override(model, source)
            raise error
        old = self._served.get(name, {})
        for version in chosen:
            if version not in old:
                model.states[version] = _VersionState(LOADING)
        results = await asyncio.gather(
            *(self._build(name, source, v, available[v], raw_config, where, trust) for v in chosen),
            return_exceptions=True,
        )
        new: dict[int, ServedModel] = {}
        failures: dict[int, InferenceError] = {}
        for version, result in zip(chosen, results, strict=True):
            if isinstance(result, ServedModel):
                new[version] = result
            elif isinstance(result, InferenceError):
                failures[version] = result
            else:
                failures[version] = internal(f"model {name} version {version}: {result}")
        for version in missing:
            reason = f"version folder {version} named by the version policy does not exist in {source}"
            model.states[version] = _VersionState(UNAVAILABLE, reason)
            log.warning("model %s version %d unavailable: %s", name, version, reason)

        if failures and old:  # keep what serves now; throw the new set away
            await self._retire(name, list(new.values()), drain=False)
            for version in chosen:
                if version not in old:
                    reason = failures[version].message if version in failures else "reload failed"
                    model.states[version] = _VersionState(UNAVAILABLE, reason)
            self._forget_override(model, source)
            raise self._combined(name, failures, kept=sorted(old))

        # The swap: one assignment; requests that already hold an old version finish on it.
        if new:
            self._served[name] = new
            model.error = ""
        else:
            self._served.pop(name, None)
        retiring = list(old.values())
        for version in new:
            model.states[version] = _VersionState(READY)
        for version, error in failures.items():
            model.states[version] = _VersionState(UNAVAILABLE, error.message)
        dropped = [v for v in old if v not in new]
        for version in dropped:
            model.states[version] = _VersionState(UNLOADING)
            log.info("model %s version %d unloading", name, version)
        await self._retire(name, retiring, drain=True)
        for version in dropped:
            model.states[version] = _VersionState(UNAVAILABLE, "unloaded")
            log.info("model %s version %d unloaded", name, version)
        model.override_dirs = overrides.prune(model.override_dirs, [m.model_dir for m in new.values()])
        if failures:
            raise self._combined(name, failures, kept=[])

    async def unload(self, name: str, unload_dependents: bool = False) -> None:
        """Stop serving `name`: no new requests (UNAVAILABLE), queued ones finish, then close.
        An ensemble using `name` stops serving with it (NOT READY); `unload_dependents` unloads such
        ensembles too (Triton's unload_dependents)."""
        if unload_dependents:
            for ensemble in ensembles.dependents(self._served, name):
                await self.unload(ensemble, unload_dependents=True)
        model = self._models.get(name)
        if model is None:
            if name in self.folders():
                return  # in the repository but not loaded: nothing to do
            raise not_found(f"failed to unload '{name}': model is not found")
        self.budget.unloaded(name)
        async with model.lock:
            model.wanted = False
            old = self._served.pop(name, {})
            for version in old:
                model.states[version] = _VersionState(UNLOADING)
                log.info("model %s version %d unloading", name, version)
            await self._retire(name, list(old.values()), drain=True)
            for version in list(model.states):
                model.states[version] = _VersionState(UNAVAILABLE, "unloaded")
            for version in old:
                log.info("model %s version %d unloaded", name, version)
            model.override_dirs = overrides.prune(model.override_dirs, [])

    # -- helpers -----------------------------------------------------------------------------------
    def _source(
        self, name: str, config_json: str | None, files: dict[str, bytes] | None
    ) -> tuple[Path, Any, str, origin.Provenance]:
        """Blocking: (model folder, raw config, where errors point, where it all came from) for a load
        request, its config checked for that origin before any version is built (origin.py)."""
        if files:
            request_files.check(name, config_json, files, self.settings.repository)  # before any write
            source = overrides.write_files(self.settings.server.state_dir, name, files)
        else:
            clash = self.clashes().get(name)
            if clash is not None:
                raise invalid_arg(f"failed to load '{name}': {clash}")
            found = self.folders().get(name)
            if found is None:
                raise not_found(
                    f"failed to load '{name}': no folder '{name}' in model repository {self.root}"
                    " or the active bundle"
                )
            source = found
            bundle_files.check_source(name, self.settings.server.state_dir, source)  # a bundle's: as signed
        kind = origin.Origin.REQUEST_FILES if files else origin.Origin.LOCAL
        try:
            raw, where = self._raw_config(name, source, config_json)
            own = None
            if config_json is not None and not files:
                kind, own = origin.Origin.API_CONFIG, origin.own_config(source / CONFIG_FILE)
            trust = origin.admit(name, source, raw, where, kind, own, repository=self.root)
        except InferenceError:
            if files:
                overrides.remove(source)
            raise
        return source, raw, where, trust

    @staticmethod
    def _raw_config(name: str, source: Path, config_json: str | None) -> tuple[Any, str]:
        config_file = source / CONFIG_FILE
        if config_json is not None:
            where = f"load request config for '{name}'"
            return parse_override(config_json, where), where
        if config_file.is_file():
            return parse_pbtxt(config_file), str(config_file)
        if _only_model_py(source):  # Triton: model.py's auto_complete_config completes it (in a worker)
            return mc.ModelConfig(backend="python"), f"{source} (no {CONFIG_FILE}; a Python model)"
        return mc.ModelConfig(), f"{source} (no {CONFIG_FILE}; auto-completed)"

    async def _build(self, name: str, source: Path, version: int, version_dir: Path, raw_config: Any,
                     where: str, trust: origin.Provenance) -> ServedModel:  # fmt: skip
        if is_ensemble(raw_config):
            log.info("model %s version %d loading (ensemble)", name, version)
            try:
                return ensembles.build_ensemble(name, source, version, raw_config, where, self.get,
                                                self.touch, self.load_on_demand)  # fmt: skip
            except InferenceError as exc:
                log.error("model %s version %d failed: %s", name, version, exc.message)
                raise
        if self._slots is None:
            self._slots = asyncio.Semaphore(LOAD_PARALLELISM)
        log.info("model %s version %d loading", name, version)
        start = time.monotonic()
        try:
            prepared = await self.budget.prepare(
                name, version, version_dir, raw_config, self._slots, prepare_version, self.selector, name,
                source, version, version_dir, raw_config, where, self.settings.runtime.default_max_batch_size,
                trust,
            )  # fmt: skip
            seconds = time.monotonic() - start
            served = self.budget.serve(prepared, lambda: build_served(name, source, prepared, seconds))
        except InferenceError as exc:
            log.error("model %s version %d failed: %s", name, version, exc.message)
            raise
        except Exception as exc:
            log.exception("model %s version %d failed", name, version)
            raise internal(f"model {name} version {version}: {exc}") from exc
        extra = f" ({served.fallback_reason})" if served.fallback_reason else ""
        options = prepared.choice.options
        threads = getattr(served.instances[0], "threads", 0) if served.instances else 0  # after a probe
        log.info("model %s version %d ready in %.2fs backend=%s device=%s precision=%s threads=%d "
                 "instances=%d%s", name, version, seconds, served.backend_name, options.device,
                 options.precision, threads or options.threads, len(served.instances), extra)  # fmt: skip
        log.info("model %s version %d plan: %s", name, version, served.choice_reason)
        return served

    async def _retire(self, name: str, models: list[ServedModel], drain: bool) -> None:
        """Drain (queued requests finish) and close old versions, all at once."""
        timeout = float(self.settings.server.exit_timeout_s)

        async def retire(served: ServedModel) -> None:
            try:
                if drain and not await served.managed_scheduler.drain(timeout):
                    log.warning("model %s version %d: requests still queued after %.0fs; failing them",
                                name, served.version, timeout)  # fmt: skip
            except Exception:
                log.exception("model %s version %d: drain failed", name, served.version)
            try:
                await asyncio.to_thread(served.managed_scheduler.close)  # also closes the instances
            except Exception:
                log.exception("model %s version %d: close failed", name, served.version)
                await asyncio.to_thread(close_instances, served.instances, f"model {name}")
            self.budget.retired(served)

        await asyncio.gather(*(retire(m) for m in models))

    def _forget_override(self, model: _Model, source: Path) -> None:
        if source in model.override_dirs:
            model.override_dirs.remove(source)
            overrides.remove(source)

    @staticmethod
    def _combined(name: str, failures: dict[int, InferenceError], kept: list[int]) -> InferenceError:
        parts = [f"version {v}: {e.message}" for v, e in sorted(failures.items())]
        text = f"failed to load '{name}': " + "; ".join(parts)
        if kept:
            text += f" (still serving version(s) {', '.join(map(str, kept))})"
        status = next(iter(failures.values())).status
        return InferenceError(status, text)


if TYPE_CHECKING:  # mypy proves the data plane's contract holds

    def _conforms(repository: ModelRepository) -> RepositoryLike:
        return repository


def _only_model_py(source: Path) -> bool:
    """A version folder holds model.py and no other backend's model file (issue 35)."""
    others = [f for f in DEFAULT_FILENAMES.values() if f != "model.py"]
    with contextlib.suppress(OSError):
        for folder in source.iterdir():
            if is_version_name(folder.name) and (folder / "model.py").is_file():
                return not any((folder / other).exists() for other in others)
    return False
