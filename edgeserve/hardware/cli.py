"""`edgeserve detect [--root DIR] [--model-repository DIR] [--json]`: the hardware, the device profile and
the runtime plan for every model, with the reason for each rejected option.

`edgeserve detect --model DIR [--fresh] [--json]`: one model folder's plan and its load-time race (every
candidate timed, the rejected ones and why, the winner), read from the race cache when this box has
raced it already; no server is started."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from edgeserve.config import ConfigError, Settings, load_settings
from edgeserve.hardware.accuracy import AccuracyGuard, default_cache_dir
from edgeserve.hardware.plan import ModelPlan, Planner
from edgeserve.hardware.probes import probe_hardware
from edgeserve.hardware.profile import DeviceProfile, load_profiles, match_profile
from edgeserve.hardware.runtimes import detect_runtimes
from edgeserve.protocol.errors import InferenceError


def _models(repository: Path) -> list[tuple[str, Path | None, Any, str | None]]:
    """(name, latest version folder, raw config, error) per model folder."""
    from edgeserve.repository.config import parse_pbtxt
    from edgeserve.repository.layout import CONFIG_FILE, list_models, version_dirs

    found: list[tuple[str, Path | None, Any, str | None]] = []
    for name in list_models(repository):
        model_dir = repository / name
        versions = version_dirs(model_dir)
        config, error = None, None
        if (model_dir / CONFIG_FILE).exists():
            try:
                config = parse_pbtxt(model_dir / CONFIG_FILE)
            except InferenceError as exc:
                error = exc.message
        if not versions:
            error = error or "no numeric version folder"
        found.append((name, versions[max(versions)] if versions else None, config, error))
    return found


def _profile_dict(profile: DeviceProfile) -> dict[str, Any]:
    return {
        "name": profile.name, "description": profile.description, "source": profile.source,
        "match": dict(profile.match), "threads": profile.threads, "reserve_cores": profile.reserve_cores,
        "streams": profile.streams, "memory_headroom_mb": profile.memory_headroom_mb,
        "candidates": [
            {"backend": c.backend, "device": c.device, "precisions": list(c.precisions),
             "providers": list(c.providers), "min_model_bytes": c.min_model_bytes}
            for c in profile.candidates
        ],
    }  # fmt: skip


def _print_plan(plan: ModelPlan) -> None:
    version = f" v{plan.version}" if plan.version else ""
    if plan.chosen is None or plan.options is None:
        print(f"  {plan.model}{version}: NO BACKEND — {plan.error}")
    else:
        o = plan.options
        providers = f" providers={','.join(o.providers)}" if o.providers else ""
        head = f"{plan.chosen.option.backend} device={o.device} precision={o.precision} threads={o.threads}"
        print(f"  {plan.model}{version}: {head}{providers}")
        artifact = plan.chosen.artifact.name if plan.chosen.artifact else "?"
        print(f"      chosen   {plan.chosen.option.label()} <- {artifact}: {plan.chosen.reason}")
    for verdict in plan.rejected:
        print(f"      rejected {verdict.option.label()}: {verdict.reason}")
    for verdict in plan.fallbacks:
        print(f"      fallback {verdict.option.label()}: {verdict.reason}")
    for verdict in plan.skipped:
        print(f"      skipped  {verdict.option.label()}: {verdict.reason}")


def _race_model(args: argparse.Namespace, settings: Settings, planner: Planner) -> int:
    """`detect --model DIR`: plan and race one model folder here."""
    from edgeserve.hardware.race import Racer
    from edgeserve.hardware.race_result import RaceCache
    from edgeserve.repository.config import parse_pbtxt
    from edgeserve.repository.layout import CONFIG_FILE, version_dirs

    model_dir = Path(args.model)
    versions = version_dirs(model_dir) if model_dir.is_dir() else {}
    if not versions:
        print(f"edgeserve detect: --model {model_dir} has no numeric version folder", file=sys.stderr)
        return 2
    where = str(model_dir / CONFIG_FILE)
    try:
        config = parse_pbtxt(model_dir / CONFIG_FILE) if (model_dir / CONFIG_FILE).exists() else None
    except InferenceError as exc:
        print(f"edgeserve detect: {exc.message}", file=sys.stderr)
        return 2
    name = config.name if config is not None and config.name else model_dir.resolve().name
    version_dir = versions[max(versions)]
    plan = planner.plan_model(name, version_dir, config, where)
    budget = settings.runtime.race_budget_s if planner.guard is not None else 0.0
    racer = Racer(planner, RaceCache(default_cache_dir(settings)), budget)
    race = racer.run(plan, name, version_dir, config, where, fresh=bool(getattr(args, "fresh", False)))
    if getattr(args, "json", False):
        out = {"model": name, "plan": plan.to_dict(), "race": race.to_dict() if race else None,
               "race_budget_s": budget, "cached": bool(race and race.cached)}  # fmt: skip
        print(json.dumps(out, indent=2, default=str))
        return 0
    print(f"profile:  {planner.profile.name} — {planner.profile.description} [{planner.profile.source}]")
    print(f"rule:     {planner.rule.basis}")
    _print_plan(plan)
    if race is None:
        if planner.guard is None:
            why = "the probed root is not this machine"
        elif budget <= 0:
            why = "runtime.race_budget_s is 0"
        else:
            why = "an accelerator's choice, or one candidate (the config fixes the rest): nothing to race"
        print(f"  race: not run ({why}); the profile's order decides")
        return 0
    when = "cached" if race.cached else f"{race.seconds:.1f}s"
    print(f"  race ({when}, budget {race.budget_s:g}s, inputs: {race.inputs or '?'}):")
    for line in race.table():
        print(f"  {line}")
    print(f"  => {race.summary()}")
    return 0


def detect_command(args: argparse.Namespace) -> int:
    root = Path(getattr(args, "root", None) or "/")
    if not root.is_dir():
        print(f"edgeserve detect: --root {root} is not a folder", file=sys.stderr)
        return 2
    try:
        settings: Settings = load_settings(getattr(args, "config", None))
    except ConfigError as exc:
        print(f"edgeserve detect: {exc}", file=sys.stderr)
        return 2
    hw = probe_hardware(root)
    runtimes = detect_runtimes(root)
    profile = match_profile(hw, load_profiles([settings.runtime.device_profiles]))
    guard = AccuracyGuard(default_cache_dir(settings)) if hw.is_live else None
    planner = Planner(hw, profile, runtimes, settings, guard)
    if getattr(args, "model", None) is not None:
        return _race_model(args, settings, planner)
    repository = Path(getattr(args, "model_repository", None) or settings.server.model_repository)

    plans: list[ModelPlan] = []
    races: dict[str, Any] = {}  # model -> the cached race (the whole repository is not raced here)
    errors: list[dict[str, str]] = []
    ensembles: dict[str, list[str]] = {}  # an ensemble has no backend: its steps run on their own plans
    for name, version_dir, config, error in _models(repository):
        if error is None and config is not None and config.platform == "ensemble":
            ensembles[name] = [step.model_name for step in config.ensemble_scheduling.step]
            continue
        if error is not None or version_dir is None:
            errors.append({"model": name, "error": error or "no version"})
            continue
        where = str(repository / name / "config.pbtxt")
        try:
            plans.append(planner.plan_model(name, version_dir, config, where))
        except InferenceError as exc:
            errors.append({"model": name, "error": exc.message})
            continue
        if guard is not None and settings.runtime.race_budget_s > 0:
            from edgeserve.hardware.race import Racer
            from edgeserve.hardware.race_result import RaceCache

            racer = Racer(planner, RaceCache(default_cache_dir(settings)), settings.runtime.race_budget_s)
            cached = racer.run(plans[-1], name, version_dir, config, where, cached_only=True)
            if cached is not None:
                races[plans[-1].model] = cached

    threads, threads_why = planner.threads()
    if getattr(args, "json", False):
        out = {
            "root": str(root), "hardware": hw.to_dict(), "runtimes": {
                "source": runtimes.source, "ort_providers": list(runtimes.ort_providers()),
                "backend_modules": sorted(runtimes.backend_modules),
                **{k: {"available": v.available, "version": v.version, "distribution": v.distribution,
                       "detail": v.detail} for k, v in runtimes.runtimes.items()},
            },
            "profile": {**_profile_dict(profile), "rule": planner.rule.to_dict()},
            "threads": {"count": threads, "reason": threads_why},
            "memory_budget_bytes": planner.memory_budget(), "accuracy_guard": guard is not None,
            "model_repository": str(repository), "models": [p.to_dict() for p in plans], "errors": errors,
            "ensembles": ensembles,
            "races": {name: race.to_dict() for name, race in races.items()},
        }  # fmt: skip
        print(json.dumps(out, indent=2, default=str))
        return 0

    print(f"hardware (root {root}):")
    for line in hw.summary_lines():
        print(f"  {line}")
    print(f"runtimes ({runtimes.source}):")
    for line in runtimes.describe():
        print(f"  {line}")
    print(f"profile:  {profile.name} — {profile.description} [{profile.source}]")
    print(f"rule:     {planner.rule.basis}")
    print(f"threads:  {threads} ({threads_why})")
    if not guard:
        print(
            "accuracy: the guard for lower precisions runs on the device at load (probe root is not this box)"
        )
    found = plans or errors or ensembles
    print(f"models in {repository}:" if found else f"models: none found in {repository}")
    for plan in plans:
        _print_plan(plan)
        if plan.model in races:
            print(f"      race     {races[plan.model].summary()} (edgeserve detect --model for the table)")
    for name, steps in ensembles.items():
        chain = " -> ".join(steps)
        print(f"  {name}: ensemble of {len(steps)} steps ({chain}); each step runs on its model's plan")
    for problem in errors:
        print(f"  {problem['model']}: ERROR {problem['error']}")
    return 0
