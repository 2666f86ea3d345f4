"""`edgeserve tune MODEL --int8`: calibrate INT8 candidates here, keep those past the accuracy guard and
hand them to the tune's race as extra models (sent with the load request, as `--int8-model` files).

Before any server starts: the calibration samples (calibration.py), ONNX Runtime static QDQ and, where
NNCF is installed, OpenVINO post-training quantization (int8.py), both judged on held-out rows
(int8_guard.py). A candidate that fails is discarded with the reason; when none passes the tune stops
and writes nothing. Passed candidates and their verdicts go to `<out-dir>/int8/` (the tune's results
folder: a rerun with the same model, samples and scheme reuses them, `--fresh` calibrates again).
`--apply` installs the winner into the model folder (the model file, then config.pbtxt, each by an
atomic rename; the previous config.pbtxt saved as `<out-dir>/config.pbtxt.before`), where the runtime
plan picks it up at the next load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edgeserve.bench import int8
from edgeserve.bench.calibration import collect
from edgeserve.bench.errors import BenchError
from edgeserve.bench.int8_guard import Thresholds, check

ENGINES = ("onnxruntime", "nncf")
RESULTS = "int8"  # <out-dir>/int8/


class Int8Rejected(BenchError):
    """No INT8 candidate passed the accuracy guard."""


@dataclass(frozen=True)
class Int8Options:
    source: str = "auto"
    folder: Path | None = None
    max_rows: int = 256
    holdout: float = 0.25
    batch: int = 8
    method: str = "minmax"
    limits: Thresholds = field(default_factory=Thresholds)
    engines: tuple[str, ...] = ENGINES
    work_root: Path | None = None  # default: the appliance's cache folder
    apply: bool = False


@dataclass(frozen=True)
class ExtraModel:
    """One more artifact to race: Candidate.model tag, its files (relative to the model folder)."""

    tag: str
    files: dict[str, Path]
    backends: tuple[str, ...] = ()  # () = every backend
    note: str | None = None  # the guard's verdict: the race does not judge it again on random inputs

    def payload(self, model_dir: Path) -> dict[str, bytes]:
        """What the load request sends: the model folder is served from these files alone, so the
        warm-up's input files go along."""
        from edgeserve.repository.layout import WARMUP_DIR

        warmup = model_dir / WARMUP_DIR
        shared = sorted(p for p in warmup.rglob("*") if p.is_file()) if warmup.is_dir() else []
        files = {p.relative_to(model_dir).as_posix(): p for p in shared}
        return {name: path.read_bytes() for name, path in {**files, **self.files}.items()}


def _sha16(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def given_model(path: Path, version: str) -> ExtraModel:
    """`--int8-model FILE.onnx`: quantized elsewhere, held to the race's accuracy check."""
    if not path.is_file() or path.suffix != ".onnx":
        raise BenchError(f"--int8-model {path}: not an .onnx file")
    return ExtraModel("int8:" + _sha16(path), {f"{version}/{int8.ORT_FILENAME}": path})


def default_work_root() -> Path:
    """The appliance's cache folder (runtime.cache_dir, <state_dir>/cache, ~/.cache/edgeserve)."""
    from edgeserve.hardware.accuracy import default_cache_dir

    try:
        from edgeserve.settings_tools import load_layered

        settings = load_layered(None)[0]
        found = default_cache_dir(settings)
    except Exception:  # an unreadable settings file must not stop a tune: the user's cache then
        found = None
    return found or Path.home() / ".cache" / "edgeserve"


def completed_config(model_dir: Path, fp32: Path) -> Any:
    """The model's config.pbtxt auto-completed from the ONNX model (as the server would), for the
    warm-up samples' shapes."""
    from tritonclient.grpc import model_config_pb2 as mc

    from edgeserve.backends.base import get_backend
    from edgeserve.config_sections import RuntimeSection
    from edgeserve.repository import autocomplete
    from edgeserve.repository.config import parse_pbtxt

    path = model_dir / "config.pbtxt"
    try:
        config = parse_pbtxt(path) if path.is_file() else mc.ModelConfig()
        return autocomplete.complete(
            config, get_backend("onnxruntime").inspect(fp32), model_name=model_dir.name,
            backend_name="onnxruntime", platform="", model_file=fp32.name,
            default_max_batch_size=RuntimeSection().default_max_batch_size, where=str(path),
        )  # fmt: skip
    except Exception as exc:  # the server would refuse it the same way: one line, not a traceback
        raise BenchError(f"{model_dir.name}: {getattr(exc, 'message', exc)}") from None


def _extras(folder: Path, version: str, verdicts: dict[str, Any]) -> list[ExtraModel]:
    found = []
    onnx_file = folder / int8.ORT_FILENAME
    if onnx_file.is_file() and verdicts.get("onnxruntime", {}).get("ok"):
        note = "int8 guard: " + verdicts["onnxruntime"]["reason"]
        found.append(ExtraModel("int8:" + _sha16(onnx_file), {f"{version}/{int8.ORT_FILENAME}": onnx_file},
                                note=note))  # fmt: skip
    xml = folder / "ir" / int8.IR_FILENAME
    if xml.is_file() and verdicts.get("nncf", {}).get("ok"):
        files = {f"{version}/{int8.IR_FILENAME}": xml, f"{version}/{xml.with_suffix('.bin').name}":
                 xml.with_suffix(".bin")}  # fmt: skip
        found.append(ExtraModel("int8-ir:" + _sha16(xml), files, ("openvino",),
                                "int8 guard: " + verdicts["nncf"]["reason"]))  # fmt: skip
    return found


def calibrate(options: Int8Options, model_dir: Path, version_dir: Path, out_dir: Path, fresh: bool,
              say: int8.Say) -> list[ExtraModel]:  # fmt: skip
    """The INT8 candidates that passed the guard (raises Int8Rejected when none did)."""
    fp32 = version_dir / "model.onnx"
    if not fp32.is_file():
        raise BenchError(f"--int8 calibrates an ONNX model: no model.onnx in {version_dir}")
    results = out_dir / RESULTS
    if fresh:
        shutil.rmtree(results, ignore_errors=True)
    config = completed_config(model_dir, fp32)
    samples = collect(fp32, model_dir, config, options.source, options.folder, options.max_rows,
                      options.holdout)  # fmt: skip
    say(f"int8: {len(samples.calibration)} rows to calibrate on, {len(samples.held_out)} held out for the "
        f"accuracy guard, from {samples.source}")  # fmt: skip
    if not samples.real:
        say("int8: warning: random data in the warm-up's shapes is a weak stand-in for real inputs; give "
            "--calibration DIR or ship calibration/ samples for a calibration you can trust")  # fmt: skip
    scheme = int8.scheme_for(int8.cpu_flags())
    engines = [e for e in options.engines if e in ENGINES]
    parts = [_sha16(fp32), samples.digest(), scheme.key(), options.method, options.batch]
    blob = json.dumps([*parts, int8.ort_version(), engines])
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    earlier = _read_results(results, key)
    if earlier is not None:
        kept = _extras(results, version_dir.name, _rejudge(earlier, options.limits))
        if kept:
            say(f"int8: calibrated by an earlier run (same model, samples and scheme; {results}): reused")
            return kept
    with int8.WorkDir(options.work_root or default_work_root(), key) as work:
        removed = work.clean_stale()
        if removed:
            say(
                f"int8: removed what an interrupted run left half-written ({work.path}): {', '.join(removed)}"
            )
        made: dict[str, Path] = {}
        if "onnxruntime" in engines:
            batched = config.max_batch_size > 0
            made["onnxruntime"] = int8.quantize_ort(
                fp32, samples, scheme, work, options.batch, options.method, batched, say
            )
        if "nncf" in engines:
            if int8.nncf_available():
                made["nncf"] = int8.quantize_nncf(fp32, samples, work, say)
            else:
                say("int8: NNCF is not installed (pip install 'edgeserve[int8]'): OpenVINO post-training "
                    "quantization skipped")  # fmt: skip
        verdicts: dict[str, Any] = {}
        for engine, path in made.items():
            verdict = check(fp32, path, samples.held_out, options.limits)
            verdicts[engine] = verdict.to_dict()
            say(
                f"int8 {engine}: "
                + ("kept: " if verdict.ok else "rejected by the accuracy guard: ")
                + verdict.reason
            )
        if not any(v["ok"] for v in verdicts.values()):
            work.remove()  # discarded: nothing of it is kept
            reasons = "; ".join(f"{e}: {v['reason']}" for e, v in verdicts.items()) or "no engine ran"
            raise Int8Rejected(f"no INT8 candidate passed the accuracy guard ({reasons}); nothing written")
        record = {
            "key": key,
            "scheme": scheme.why,
            "samples": samples.source,
            "verdicts": verdicts,
            "limits": {"min_top1": options.limits.min_top1, "max_error": options.limits.max_error},
        }
        _write_results(results, made, verdicts, record)  # fmt: skip
        work.remove()
    return _extras(results, version_dir.name, verdicts)


def _read_results(results: Path, key: str) -> dict[str, Any] | None:
    try:
        record: dict[str, Any] = json.loads((results / "int8.json").read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("key") == key else None


def _rejudge(record: dict[str, Any], limits: Thresholds) -> dict[str, Any]:
    """Earlier verdicts held to today's thresholds (from their figures, without running again)."""
    from edgeserve.bench.int8_guard import judge_figures

    return {e: judge_figures(v, limits) for e, v in (record.get("verdicts") or {}).items()}


def _write_results(results: Path, made: dict[str, Path], verdicts: dict[str, Any], record: Any) -> None:
    """<out-dir>/int8/ replaced whole: built as int8.part/, then renamed."""
    part = results.with_name(results.name + ".part")
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    for engine, path in made.items():
        if not verdicts[engine]["ok"]:
            continue
        if path.suffix == ".xml":
            shutil.copytree(path.parent, part / "ir")
        else:
            shutil.copyfile(path, part / path.name)
    (part / "int8.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(results, ignore_errors=True)
    os.replace(part, results)


def finish(won: ExtraModel | None, raced: Sequence[str], options: Int8Options | None, output: Path,
           model_dir: Path, version_dir: Path, out_dir: Path, say: int8.Say, winner: str = "",
           measured: Collection[str] = ()) -> None:  # fmt: skip
    """After the race: the winning INT8 files beside the written config.pbtxt; with --apply, both into the
    model folder. `raced`: the INT8 candidates' tags, `measured`: the tags the race measured."""
    for relative, source in won.files.items() if won is not None else ():
        shutil.copyfile(source, output.parent / Path(relative).name)
    apply = options is not None and options.apply
    if won is not None and not apply:
        names = ", ".join(Path(r).name for r in won.files)
        print(f"the winner serves the INT8 model: copy {names} from {output.parent} into {version_dir} with "
              "this config.pbtxt (or run again with --apply)")  # fmt: skip
    elif options is not None and raced and won is None:
        # the winner may be bf16 as well as fp32 (on AMX / AVX512-BF16 CPUs it often is), and a race cut
        # short by --max-candidates may not have measured every INT8 candidate
        unmeasured = [tag.split(":")[0] for tag in raced if tag not in measured]
        winner = winner or "fp32"
        if len(unmeasured) == len(raced):
            print("the INT8 candidates passed the accuracy guard, but the race stopped before measuring them "
                  f"(run again to continue): the config serves {winner}")  # fmt: skip
        else:
            rest = (
                f"; not measured yet: {', '.join(unmeasured)} (run again to continue)" if unmeasured else ""
            )
            print(f"the INT8 candidates passed the accuracy guard but lost the race to {winner}: the config "
                  f"serves that{rest}")  # fmt: skip
    if apply:
        apply_winner(won, output, model_dir, out_dir, say)


def apply_winner(
    extra: ExtraModel | None, written: Path, model_dir: Path, out_dir: Path, say: int8.Say
) -> None:
    """`--apply`: the winner's files into the model folder, then its config.pbtxt (so the config never
    names a file that is not there yet); each through a temporary file and a rename."""
    for relative, source in extra.files.items() if extra is not None else ():
        target = model_dir / relative
        int8.remove_stale_copies(target.parent, target.name)
        int8.copy_atomic(source, target)
        say(f"applied: {target}")
    config = model_dir / "config.pbtxt"
    int8.remove_stale_copies(model_dir, config.name)
    backup = out_dir / "config.pbtxt.before"
    if config.is_file() and not backup.exists():
        shutil.copyfile(config, backup)
        say(f"the previous config.pbtxt is saved as {backup}")
    int8.copy_atomic(written, config)
    say(f"applied: {config}")


def int8_options(args: Any) -> Int8Options | None:
    """From `edgeserve tune`'s flags (None without --int8; the calibration flags need it)."""
    if not getattr(args, "int8", False):
        if getattr(args, "calibration", None) is not None or getattr(args, "apply", False):
            raise BenchError("--calibration and --apply go with --int8")
        return None
    if not 0 < args.holdout < 1:
        raise BenchError(f"--holdout {args.holdout:g}: a share of the samples, between 0 and 1")
    if not 0 <= args.int8_min_top1 <= 1 or not args.int8_max_error > 0:
        raise BenchError("--int8-min-top1 is a share (0..1) and --int8-max-error above 0")
    if args.calibration_samples < 2 or args.calibration_batch < 1:
        raise BenchError("--calibration-samples needs 2 or more, --calibration-batch 1 or more")
    engines = tuple(e.strip() for e in args.int8_engines.split(",") if e.strip())
    unknown = set(engines) - set(ENGINES)
    if not engines or unknown:
        raise BenchError(f"--int8-engines {args.int8_engines!r}: a comma list of {', '.join(ENGINES)}")
    return Int8Options(
        source=args.calibration_source, folder=args.calibration, max_rows=args.calibration_samples,
        holdout=args.holdout, batch=args.calibration_batch, method=args.calibration_method,
        limits=Thresholds(args.int8_min_top1, args.int8_max_error), engines=engines, work_root=args.work_dir,
        apply=args.apply,
    )  # fmt: skip
