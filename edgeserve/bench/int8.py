"""INT8 by calibration: ONNX Runtime static QDQ quantization, OpenVINO post-training quantization with
NNCF where installed, in a work folder that an interrupted run resumes or cleans up.

The scheme follows the CPU (onnxruntime.quantization.quantize_static's guidance, and OpenVINO's note on
the saturation issue): QDQ, u8 activations x s8 per-channel weights; full 8-bit weights where the CPU
has VNNI (AVX512-VNNI, AVX-VNNI, AMX-INT8), 7-bit weights (`reduce_range`) on x86 without it, where the
u8 x s8 pair sums of AVX2/AVX-512 (vpmaddubsw) saturate; s8 x s8 on ARM (dot-product instructions).

Work folder `<cache>/int8/<key>/` (key: model bytes, samples, scheme, runtime version), locked while a
run uses it. Each step writes `*.part` and renames when done, so a kill leaves only `.part` files and
ORT's scratch (`tmp/`): the next run removes those and resumes from the last finished step (the
calibration ranges, then the quantized model). Nothing is written outside it until the guard passed.
The folder is the service user's alone (0700), and each finished step is sealed (backends/cache.py): a
file of an interrupted run is reused only when edgeserve wrote it and it has not changed since.
"""

from __future__ import annotations

import contextlib
import fcntl
import inspect
import os
import platform
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeserve.backends.cache import is_sealed, seal_existing
from edgeserve.bench.calibration import Reader, Samples, batches
from edgeserve.bench.errors import BenchError

Say = Callable[[str], None]
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
ORT_FILENAME = "model_int8.onnx"
IR_FILENAME = "model_int8.xml"
PER_CHANNEL_OPSET = 13  # DequantizeLinear with an axis
RESUMED = "an interrupted INT8 run's file"


def _resumable(*files: Path) -> bool:
    """The finished step of an interrupted run may be reused: every file of it is sealed and unchanged
    (one that is not is discarded with a warning, and the step runs again)."""
    return all(f.is_file() for f in files) and all([is_sealed(f, RESUMED) for f in files])


def _finish(part: Path, done: Path, *files: Path) -> None:
    """Rename a step's output into place and seal it (`files`: those inside a finished folder)."""
    for file in files or (part,):
        os.chmod(file, 0o600)  # runtimes write with the umask (group-writable in the unit)
    os.replace(part, done)
    for file in files or (done,):
        seal_existing(done / file.name if files else file)


@dataclass(frozen=True)
class Scheme:
    activations: str  # "uint8" | "int8"
    reduce_range: bool
    per_channel: bool
    why: str

    def key(self) -> str:
        return f"{self.activations}|s8|rr{int(self.reduce_range)}|pc{int(self.per_channel)}"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The CPU's feature flags (x86 `flags`, ARM `Features`)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return set()
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip().lower() in ("flags", "features"):
            flags.update(value.split())
    return flags


def scheme_for(flags: set[str], machine: str | None = None) -> Scheme:
    machine = (machine or platform.machine()).lower()
    if machine in ("aarch64", "arm64") or machine.startswith("arm"):
        dot = "asimddp" in flags
        return Scheme(
            "int8",
            False,
            True,
            "ARM: s8 activations x s8 weights"
            + (
                " (dot-product instructions)"
                if dot
                else " (no dot-product instructions: expect a small gain)"
            ),
        )
    vnni = [f for f in VNNI_FLAGS if f in flags]
    if vnni:
        return Scheme("uint8", False, True, f"x86 with {', '.join(vnni)}: u8 x s8, full 8-bit weights")
    isa = "avx512bw" if "avx512bw" in flags else "avx2" if "avx2" in flags else "no avx2"
    return Scheme("uint8", True, True, f"x86 without VNNI ({isa}): u8 x s8 with 7-bit weights (reduce_range) "
                  "against the saturation of u8 x s8 pair sums")  # fmt: skip


def ort_version() -> str:
    import onnxruntime

    return str(onnxruntime.__version__)


class WorkDir:
    """`<root>/int8/<key>/`: locked (flock) while in use; stale `.part` files and scratch removed."""

    def __init__(self, root: Path, key: str) -> None:
        self.path = root / "int8" / key
        self._lock: Any = None

    def __enter__(self) -> WorkDir:
        self.path.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = os.lstat(self.path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise BenchError(f"the work folder {self.path} is not edgeserve's (uid {st.st_uid}); remove it")
        os.chmod(self.path, 0o700)  # nobody else writes a file we resume from
        self._lock = open(self.path / ".lock", "a+")  # held until __exit__
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise BenchError(
                f"another `edgeserve tune --int8` is calibrating this model ({self.path})"
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def clean_stale(self) -> list[str]:
        """Remove what an interrupted run left half-written; returns the names removed."""
        removed = []
        for entry in sorted(self.path.iterdir()):
            if entry.name.endswith(".part") or entry.name == "tmp":
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                removed.append(entry.name)
        return removed

    def remove(self) -> None:
        self.__exit__()
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            self.path.parent.rmdir()  # <cache>/int8 when it was the only one

    @contextlib.contextmanager
    def scratch(self) -> Iterator[Path]:
        """Python's temporary files go here while a runtime works (ORT's augmented model and
        `ort.quant.*` folders): a kill leaves them where the next run looks, not in /tmp."""
        folder = self.path / "tmp"
        folder.mkdir(exist_ok=True)
        before = tempfile.tempdir
        tempfile.tempdir = str(folder)
        try:
            yield folder
        finally:
            tempfile.tempdir = before
            shutil.rmtree(folder, ignore_errors=True)


def _opset_for_per_channel(model: Path, work: WorkDir, say: Say) -> Path | None:
    """The model at opset PER_CHANNEL_OPSET or later; None when it cannot be converted.

    Per-channel weights need DequantizeLinear's `axis` (opset 13), but quantize_static lifts older models
    only to opset 11 and writes the axis anyway: ONNX Runtime then refuses the model ("Unrecognized
    attribute: axis for operator DequantizeLinear"), as with ResNets exported by tf2onnx at opset 9."""
    import onnx

    done = work.path / "model_opset.onnx"
    if _resumable(done):
        return done
    proto = onnx.load(str(model))
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), PER_CHANNEL_OPSET)
    if opset >= PER_CHANNEL_OPSET:
        return model
    part = work.path / "model_opset.onnx.part"
    try:
        from onnx import version_converter

        onnx.save(version_converter.convert_version(proto, PER_CHANNEL_OPSET), str(part))
    except Exception as exc:
        part.unlink(missing_ok=True)
        say(f"  opset {opset} -> {PER_CHANNEL_OPSET} failed ({type(exc).__name__}: {str(exc)[:120]}): "
            "per-tensor weights")  # fmt: skip
        return None
    _finish(part, done)
    say(f"  opset {opset} -> {PER_CHANNEL_OPSET} (per-channel weights need it)")
    return done


def _preprocess(model: Path, work: WorkDir, say: Say) -> Path:
    """ORT's recommended pre-processing (shape inference, graph optimisation); the model as it is when
    that fails (some models do not take symbolic shape inference)."""
    done = work.path / "model_pre.onnx"
    if _resumable(done):
        return done
    part = work.path / "model_pre.onnx.part"
    try:
        import importlib.util

        from onnxruntime.quantization.shape_inference import quant_pre_process

        symbolic = importlib.util.find_spec("sympy") is not None  # ORT's symbolic shape inference needs it
        with work.scratch():
            quant_pre_process(str(model), str(part), skip_symbolic_shape=not symbolic)
        _finish(part, done)
        return done
    except Exception as exc:
        part.unlink(missing_ok=True)
        say(f"  pre-processing skipped ({type(exc).__name__}: {str(exc)[:120]}): the model quantized as is")
        return model


def quantize_ort(model: Path, samples: Samples, scheme: Scheme, work: WorkDir, batch: int, method: str,
                 batched: bool, say: Say) -> Path:  # fmt: skip
    """ONNX Runtime static QDQ quantization; the finished model's path in the work folder."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    done = work.path / ORT_FILENAME
    if _resumable(done):
        say(f"onnxruntime: the quantized model of an interrupted run is complete: reused ({done})")
        return done
    methods = {"minmax": CalibrationMethod.MinMax, "entropy": CalibrationMethod.Entropy,
               "percentile": CalibrationMethod.Percentile}  # fmt: skip
    per_channel = scheme.per_channel
    if per_channel:
        lifted = _opset_for_per_channel(model, work, say)
        per_channel, model = lifted is not None, lifted or model
    source = _preprocess(model, work, say)
    feeds = batches(samples.calibration, batch, batched)
    kwargs: dict[str, Any] = {}
    ranges = work.path / f"ranges-{method}.json"
    if "calibration_cache_path" in inspect.signature(quantize_static).parameters:
        if _resumable(ranges):
            say(f"onnxruntime: calibration ranges of an interrupted run found: resumed ({ranges.name})")
            kwargs["calibration_cache_path"] = str(ranges)
        else:
            kwargs["calibration_cache_path"] = str(ranges) + ".part"
    if "calibration_cache_path" not in kwargs or kwargs["calibration_cache_path"] != str(ranges):
        say(f"onnxruntime: calibrating on {len(samples.calibration)} rows in {len(feeds)} batch(es), "
            f"{method} ranges; {scheme.why}")  # fmt: skip
    part = work.path / (ORT_FILENAME + ".part")
    activations = QuantType.QUInt8 if scheme.activations == "uint8" else QuantType.QInt8
    with work.scratch():
        quantize_static(
            str(source), str(part), Reader(feeds, say), quant_format=QuantFormat.QDQ,
            per_channel=per_channel, reduce_range=scheme.reduce_range, activation_type=activations,
            weight_type=QuantType.QInt8, calibrate_method=methods[method],
            # no CalibMaxIntermediateOutputs: ORT 1.32 drops the chunk it clears instead of merging it
            # (and MinMax keeps only per-tensor minima and maxima anyway; entropy and percentile keep
            # whole activations: give them fewer samples)
            extra_options={"ActivationSymmetric": scheme.activations == "int8"}, **kwargs,
        )  # fmt: skip
    cache_part = Path(str(ranges) + ".part")
    if cache_part.is_file():
        _finish(cache_part, ranges)
    _finish(part, done)
    return done


def nncf_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("nncf") is not None and importlib.util.find_spec("openvino") is not None


def quantize_nncf(model: Path, samples: Samples, work: WorkDir, say: Say) -> Path:
    """OpenVINO post-training quantization (nncf.quantize, the performance preset) of the fp32 model;
    the IR's .xml in the work folder (its .bin beside it)."""
    import nncf
    import openvino as ov

    done = work.path / "ir"
    if _resumable(done / IR_FILENAME, (done / IR_FILENAME).with_suffix(".bin")):
        say(f"openvino/nncf: the quantized IR of an interrupted run is complete: reused ({done})")
        return done / IR_FILENAME
    part = work.path / "ir.part"
    shutil.rmtree(part, ignore_errors=True)
    rows = samples.calibration
    say(f"openvino/nncf: calibrating on {len(rows)} rows")
    reader = Reader(rows, say)
    dataset = nncf.Dataset(list(reader))
    with work.scratch():
        quantized = nncf.quantize(ov.Core().read_model(str(model)), dataset, subset_size=len(rows),
                                  preset=nncf.QuantizationPreset.PERFORMANCE)  # fmt: skip
        part.mkdir()
        ov.save_model(quantized, str(part / IR_FILENAME), compress_to_fp16=False)
    shutil.rmtree(done, ignore_errors=True)  # an unsealed one the check above discarded files of
    _finish(part, done, part / IR_FILENAME, (part / IR_FILENAME).with_suffix(".bin"))
    return done / IR_FILENAME


def copy_atomic(source: Path, target: Path) -> None:
    """Copy through a hidden temporary file in the target folder and a rename: a kill leaves the old
    file or the new one, and at most a `.<name>.*.tmp` that `remove_stale_copies` clears."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, target.stat().st_mode & 0o777 if target.exists() else 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def remove_stale_copies(folder: Path, name: str) -> list[Path]:
    stale = sorted(folder.glob(f".{name}.*.tmp")) if folder.is_dir() else []
    for path in stale:
        path.unlink(missing_ok=True)
    return stale
