"""PlanSelector: the runtime plan as the model repository's backend selector.

    ModelRepository(settings, selector=PlanSelector(settings))

Probes the box once (settings.runtime.hardware_root), matches a device profile (devices/ plus
settings.runtime.device_profiles), and for each model version returns the plan's choice, with the
other viable options as load-time fallbacks. With `[runtime] race_budget_s` > 0, a model is raced on
what its config leaves open (race.py: a pinned backend still races instances x threads): the fastest
candidate measured here that passes the accuracy guard is served, and the result is cached. A pinned
backend (config `backend:` / `platform:`) that cannot run here is an error naming the backend and why,
never a silent substitute.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from pathlib import Path
from typing import Any

from edgeserve.config import Settings
from edgeserve.hardware.accuracy import AccuracyGuard, default_cache_dir
from edgeserve.hardware.plan import AccuracyGuard as GuardFn
from edgeserve.hardware.plan import ModelPlan, Planner
from edgeserve.hardware.probes import HardwareInfo, probe_hardware
from edgeserve.hardware.profile import DeviceProfile, load_profiles, match_profile
from edgeserve.hardware.race import THREADS_PARAMETER, Racer
from edgeserve.hardware.race_background import BackgroundRaces
from edgeserve.hardware.race_result import RaceCache, RaceResult
from edgeserve.hardware.runtimes import RuntimeInventory, detect_runtimes
from edgeserve.protocol.errors import InferenceError, Status
from edgeserve.repository.selection import BackendChoice

log = logging.getLogger("edgeserve.hardware.selector")

_AUTO: Any = object()


class PlanSelector:
    def __init__(
        self,
        settings: Settings,
        *,
        hardware: HardwareInfo | None = None,
        runtimes: RuntimeInventory | None = None,
        profiles: list[DeviceProfile] | None = None,
        guard: GuardFn | None = _AUTO,
    ) -> None:
        root = settings.runtime.hardware_root
        self.settings = settings
        self.hardware = hardware if hardware is not None else probe_hardware(root)
        self.runtimes = runtimes if runtimes is not None else detect_runtimes(root)
        if profiles is None:
            profiles = load_profiles([settings.runtime.device_profiles])
        self.profile = match_profile(self.hardware, profiles)
        if guard is _AUTO:
            # The guard runs models on this machine: only meaningful when the probed root is this machine.
            guard = AccuracyGuard(default_cache_dir(settings)) if self.hardware.is_live else None
        self.planner = Planner(self.hardware, self.profile, self.runtimes, settings, guard)
        # The race times models on this machine: only when the probed root is this machine.
        budget = settings.runtime.race_budget_s if self.hardware.is_live and guard is not None else 0.0
        self.racer = Racer(self.planner, RaceCache(default_cache_dir(settings)), budget)
        self.background = BackgroundRaces()
        if budget > 0 and settings.runtime.race_background:
            self.racer.background = self.background
        log.info(
            "device profile %s (%s); %s", self.profile.name, self.profile.source, self.hardware.cpu.summary()
        )

    def attach(self, repository: Any, loop: asyncio.AbstractEventLoop) -> None:
        """Let background races see the served models' queues (they pause while requests queue) and
        switch a model by reloading it on the event loop (manager.py swaps atomically)."""

        def busy() -> bool:
            for served in repository.served():
                try:
                    if served.managed_scheduler.pending_count() > 0:
                        return True
                except Exception:  # an ensemble has no scheduler of its own
                    continue
            return False

        def switch(name: str) -> None:
            if not repository.is_ready(name) or loop.is_closed():
                return
            # A reload reads the model's folder: a model whose config or files came with a load request
            # would come back as the folder has it, so it keeps what serves (the cache has the winner).
            sent = [
                m.origin for m in repository.ready_versions(name) if getattr(m, "origin", "local") != "local"
            ]
            if sent:
                log.info("model %s: not switched (its %s came with a load request; load it again to switch)",
                         name, "config" if sent[0] == "load-request-config" else "files")  # fmt: skip
                return
            asyncio.run_coroutine_threadsafe(_reload(repository, name), loop)

        def confirm(name: str, result: RaceResult) -> None:
            if not loop.is_closed():
                loop.call_soon_threadsafe(self._mark_final, repository, name, result)

        self.background.attach(busy, switch, confirm)

    def _mark_final(self, repository: Any, name: str, result: RaceResult) -> None:
        """What serves won the background race: its config says so (on the loop, where it is read)."""
        text = f"device profile {self.profile.name}: {result.summary()}"
        for served in repository.ready_versions(name):
            parameters = served.config.parameters
            if "runtime_choice_final" in parameters:
                parameters["runtime_choice"].string_value = text
                parameters["runtime_choice_final"].string_value = "true"
                if "batch_size_choice" in parameters and result.batch is not None:
                    parameters["batch_size_choice"].string_value = result.batch.summary()

    def close(self) -> None:
        """Stop the background races (their candidates are closed; what serves stays)."""
        self.background.stop()

    def plan(self, model_name: str, version_dir: Path, config: Any, where: str | None = None) -> ModelPlan:
        return self.planner.plan_model(model_name, version_dir, config, where)

    def choose(self, model_name: str, model_dir: Path, version_dir: Path, config: Any) -> BackendChoice:
        where = str(model_dir / "config.pbtxt")
        plan = self.planner.plan_model(model_name, version_dir, config, where)
        if plan.chosen is None or plan.options is None:
            if plan.pins.backend:
                mine = [v for v in plan.verdicts if v.option.backend == plan.pins.backend]
                why = "; ".join(f"{v.option.label()}: {v.reason}" for v in mine) or "no option"
                raise InferenceError(
                    Status.UNAVAILABLE,
                    f"{where}: backend '{plan.pins.backend}' is pinned "
                    f"({plan.pins.backend_why}) but cannot run here: {why}",
                )
            raise InferenceError(Status.UNAVAILABLE, f"model {model_name}: {plan.error}")
        chosen = plan.chosen
        rejected = [
            f"{v.option.label()} ({v.reason})"
            for v in plan.rejected
            if not v.reason.startswith(("not the pinned", "config parameters.precision"))
        ]
        reason = f"device profile {self.profile.name}: {chosen.option.label()}: {chosen.reason}"
        if plan.pins.backend:
            reason += f"; pinned by {plan.pins.backend_why}"
        if rejected:
            reason += "; rejected: " + "; ".join(rejected)
        race = self.racer.run(plan, model_name, version_dir, config, where)
        if race is not None and race.chosen is not None:
            return self._raced(race, plan, config, version_dir)
        shown: dict[str, str] = {}
        batch = 0
        if race is not None:
            reason += f"; {race.summary()}"
            shown = {"runtime_choice": reason, "runtime_choice_final": str(race.final).lower()}
            if race.batch is not None:  # one candidate: only the batch size was raced
                shown["batch_size_choice"] = race.batch.summary()
                batch = race.batch.size
        fallbacks: tuple[BackendChoice, ...] = ()
        if not plan.pins.backend:
            fallbacks = tuple(
                BackendChoice(
                    v.option.backend,
                    v.artifact,
                    self.planner.backend_options(v.option, config),
                    f"fallback {v.option.label()}",
                )
                for v in plan.fallbacks
                if v.artifact is not None
            )
        return BackendChoice(
            chosen.option.backend,
            chosen.artifact or version_dir,
            plan.options,
            reason,
            fallbacks,
            shown=shown,
            batch=batch,
        )

    def _raced(self, race: RaceResult, plan: ModelPlan, config: Any, version_dir: Path) -> BackendChoice:
        """The race's winner, with the other timed candidates (fastest first) as fallbacks."""
        by_label = {
            (v.option.backend, v.option.device, v.option.precision): v for v in plan.verdicts if v.artifact
        }
        choices: list[BackendChoice] = []
        for row in [r for r in race.ranked() if r.status != "rejected"]:
            verdict = by_label.get((row.backend, row.device, row.precision))
            if verdict is None or verdict.artifact is None:
                continue
            base = self.planner.backend_options(verdict.option, config, plan.pins)
            parameters = dict(base.parameters)
            if row.backend == "onnxruntime":
                parameters.setdefault(THREADS_PARAMETER, str(row.threads))
            options = dataclasses.replace(base, threads=row.threads, parameters=parameters)
            choices.append(
                BackendChoice(
                    row.backend, verdict.artifact, options, f"race: {row.label()}", instances=row.instances
                )
            )
        if not choices:  # cannot happen: the winner is a timed row of the plan
            raise InferenceError(Status.INTERNAL, f"model {plan.model}: the race's winner is not in the plan")
        text = f"device profile {self.profile.name}: {race.summary()}"
        if plan.pins.backend:  # only what the config fixes is fixed: the layout was raced
            text += f"; backend pinned by {plan.pins.backend_why}, instances x threads raced"
        first = choices[0]
        shown = {"runtime_choice": text, "runtime_choice_final": str(race.final).lower()}
        if THREADS_PARAMETER in first.options.parameters:  # the raced layout, as Triton's ORT backend has it
            shown[THREADS_PARAMETER] = first.options.parameters[THREADS_PARAMETER]
        batch = race.batch.size if race.batch is not None else 0
        if race.batch is not None:
            shown["batch_size_choice"] = race.batch.summary()
        return BackendChoice(
            first.backend_name, first.model_path, first.options, text, tuple(choices[1:]),
            instances=first.instances, shown=shown, batch=batch,
        )  # fmt: skip


async def _reload(repository: Any, name: str) -> None:
    try:
        await repository.load(name)
    except Exception as exc:  # the reload keeps the old version serving when it fails
        log.warning("model %s: switching to the background race's winner failed: %s", name, exc)
