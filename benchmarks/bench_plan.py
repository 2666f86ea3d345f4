"""Runtime choice (issue 14): does the plan serve the fastest candidate measured in-process here?

For each model (the samples in models/ and the shapes in plan_models.py), `--repeat` times:
1. the load-time race as the server runs it (fresh, `[runtime] race_budget_s`, default 6 s): its winner
   is what the plan serves (or the profile's rule when the race falls back);
2. a reference measurement of the same candidates in the same process, much longer (`--reference-s`,
   up to 60 interleaved rounds, no candidate dropped at warm-up): the fastest candidate that passes
   the accuracy guard;
3. the ratio: the reference score of the plan's choice / the best reference score (1.00 = the plan
   served the fastest; the target is <= 1.05).
Score = geometric mean of the time per inference over the model's scenarios (1 in flight at batch 1;
the preferred batch sizes with one batch per instance in flight when it batches).

    .venv/bin/python benchmarks/bench_plan.py [--models mlp,ppocr_det] [--repeat 3] [--reference-s 20]

Progress goes to stderr; the markdown tables to stdout.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "benchmarks"), str(ROOT)]
from plan_models import build_all  # noqa: E402

from edgeserve.config import Settings  # noqa: E402
from edgeserve.hardware.race import Racer  # noqa: E402
from edgeserve.hardware.race_result import RaceCache, RaceResult, Row  # noqa: E402
from edgeserve.hardware.selector import PlanSelector  # noqa: E402
from edgeserve.repository.config import parse_pbtxt  # noqa: E402

SAMPLES = ("mlp", "ppocr_det", "ppocr_cls", "ppocr_rec")


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Outcome:
    model: str
    choices: list[str] = field(default_factory=list)  # what the plan served, per repeat
    ratios: list[float] = field(default_factory=list)
    fastest: list[str] = field(default_factory=list)
    race_s: list[float] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    last_race: RaceResult | None = None
    last_reference: RaceResult | None = None


def _rule_label(selector: PlanSelector, plan: Any, config: Any) -> str:
    """The rule's choice with the layout a load without a race gets."""
    option = plan.chosen.option
    instances = sum(max(int(g.count), 1) for g in getattr(config, "instance_group", [])) or 1
    threads = selector.planner.threads(instances)[0]
    hint = selector.settings.runtime.openvino_performance_hint if option.backend == "openvino" else ""
    return Row(option.backend, option.device, option.precision, instances, threads, hint).label()


def run_model(
    selector: PlanSelector, name: str, folder: Path, args: argparse.Namespace, outcome: Outcome
) -> None:
    config = parse_pbtxt(folder / "config.pbtxt") if (folder / "config.pbtxt").exists() else None
    where = str(folder / "config.pbtxt")
    plan = selector.plan(name, folder / "1", config, where)
    if plan.chosen is None:
        progress(f"{name}: no plan: {plan.error}")
        return
    start = time.monotonic()
    race = selector.racer.run(plan, name, folder / "1", config, where, fresh=True)
    outcome.race_s.append(time.monotonic() - start)
    if race is not None and race.chosen is not None:
        served = race.chosen.label()
    else:
        served = _rule_label(selector, plan, config)
        outcome.fallbacks.append(race.fallback or "" if race is not None else "not raced")
    outcome.choices.append(served)
    progress(f"{name}: the plan serves {served}; reference measurement ({args.reference_s:g}s) ...")
    reference = Racer(selector.planner, RaceCache(None), args.reference_s, max_rounds=60, prune=math.inf)
    ref = reference.run(plan, name, folder / "1", config, where, fresh=True)
    if ref is None or ref.chosen is None:
        progress(f"{name}: the reference measurement did not finish: {ref.fallback if ref else 'not raced'}")
        return
    scores = {r.label(): r.score_ms for r in ref.rows if r.score_ms is not None and r.status != "rejected"}
    best = min(scores.values())  # type: ignore[type-var]
    mine = scores.get(served)
    outcome.fastest.append(ref.chosen.label())
    if mine is not None and best:
        outcome.ratios.append(mine / best)
    outcome.last_race, outcome.last_reference = race, ref
    ratio = f"{mine / best:.3f}" if mine is not None and best else "n/a (not timed in the reference)"
    progress(f"{name}: fastest {ref.chosen.label()} {best:.3g} ms; the plan's choice is x{ratio}")


def _range(values: list[float], fmt: str = "{:.2f}") -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return fmt.format(low) if low == high else f"{fmt.format(low)} to {fmt.format(high)}"


def report(outcomes: list[Outcome], args: argparse.Namespace) -> None:
    print(
        f"Race budget {args.budget:g} s, reference {args.reference_s:g} s per model, {args.repeat} repeat(s)."
    )
    print(
        "\n| model | plan serves | fastest in the reference | ratio (target <= 1.05) | race s | fallbacks |"
    )
    print("|---|---|---|---|---|---|")
    for o in outcomes:
        served = "; ".join(dict.fromkeys(o.choices)) or "-"
        fastest = "; ".join(dict.fromkeys(o.fastest)) or "-"
        ok = "yes" if o.ratios and max(o.ratios) <= 1.05 else "no" if o.ratios else "?"
        fallbacks = "; ".join(dict.fromkeys(o.fallbacks)) or "-"
        print(f"| {o.model} | {served} | {fastest} | {_range(o.ratios, '{:.3f}')} ({ok}) | "
              f"{_range(o.race_s, '{:.1f}')} | {fallbacks} |")  # fmt: skip
    for o in outcomes:
        for title, result in (("race", o.last_race), ("reference", o.last_reference)):
            if result is None:
                continue
            print(f"\n{o.model} — last {title} ({result.seconds:.1f}s, inputs: {result.inputs}):\n```")
            print("\n".join(result.table()))
            print(f"=> {result.summary()}\n```")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="", help="comma-separated names (default: all)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget", type=float, default=Settings().runtime.race_budget_s)
    parser.add_argument("--reference-s", type=float, default=20.0)
    parser.add_argument("--workdir", type=Path, help="where the extra models are built (default: a temp dir)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("edgeserve.hardware.race").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="bench-plan-") as tmp:
        work = args.workdir or Path(tmp)
        folders = {name: ROOT / "models" / name for name in SAMPLES}
        progress("building the extra models ...")
        folders.update(build_all(work / "repo"))
        wanted = [m for m in args.models.split(",") if m] or list(folders)
        settings = Settings()
        settings.server.state_dir = work / "state"
        settings.runtime.race_budget_s = args.budget
        selector = PlanSelector(settings)
        outcomes = {name: Outcome(name) for name in wanted}
        for rep in range(args.repeat):
            for name in wanted:
                progress(f"repeat {rep + 1}/{args.repeat}: {name}")
                run_model(selector, name, folders[name], args, outcomes[name])
        report(list(outcomes.values()), args)
        ratios = [r for o in outcomes.values() for r in o.ratios]
        if ratios:
            progress(f"ratios: median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
