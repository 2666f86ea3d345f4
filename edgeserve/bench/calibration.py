"""Calibration inputs for `edgeserve tune --int8`: where they come from, and the held-out split.

Sources (`--calibration-source`, default auto = the first that has samples, in this order):
- folder: `--calibration DIR` — `.npy` files (one array per file, for a one-input model), `.npz` files
  (one array per input name) and, for a one-input image model, images (resized to the input, scaled to
  0..1 as `edgeserve bench --input-data` does; models that want mean/std normalisation take `.npy`);
- bundle: the model folder's `calibration/` folder (`.npy`/`.npz`), as `bundle build --calibration`
  ships it, signed with the bundle: real inputs the fleet vouches for;
- warmup: the config's `model_warmup` samples: `input_data_file` data as it is; `random_data` /
  `zero_data` entries give the shapes and are filled with seeded random values (a weak proxy for real
  data: the tune says so).

Every sample is split into rows along the batch axis (for a model whose first input dim is dynamic);
every `holdout`-th row is held out for the accuracy guard and never calibrated on.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.bench.errors import BenchError
from edgeserve.bench.inputs import IMAGE_SUFFIXES, TensorSpec, load_file

Array = npt.NDArray[Any]
Feed = dict[str, Array]
CALIBRATION_DIR = "calibration"  # <model>/calibration/: samples a bundle carries for the device's tune
SAMPLE_SUFFIXES = frozenset({".npy", ".npz"})
SOURCES = ("auto", "folder", "bundle", "warmup")
RANDOM_ROWS = 32  # rows made from a random_data warm-up entry (calibration + held-out)
ORT_TYPES = {"tensor(float)": "FP32", "tensor(float16)": "FP16", "tensor(double)": "FP64",
             "tensor(uint8)": "UINT8", "tensor(int8)": "INT8", "tensor(int32)": "INT32",
             "tensor(int64)": "INT64", "tensor(bool)": "BOOL"}  # fmt: skip


@dataclass(frozen=True)
class InputSpec:
    name: str
    datatype: str  # protocol name (FP32, UINT8, ...)
    dims: tuple[int, ...]  # the ONNX model's, -1 = dynamic


@dataclass(frozen=True)
class Samples:
    calibration: list[Feed]  # one row each (batch 1 where the model batches)
    held_out: list[Feed]
    source: str  # e.g. "folder /data/crops (120 rows)"
    real: bool  # False: random data filled into warm-up shapes

    def digest(self) -> str:
        h = hashlib.sha256()
        for part, feeds in (("calibration", self.calibration), ("held-out", self.held_out)):
            h.update(part.encode())
            for feed in feeds:
                for name in sorted(feed):
                    array = np.ascontiguousarray(feed[name])
                    h.update(f"{name}|{array.dtype.str}|{array.shape}".encode() + array.tobytes())
        return h.hexdigest()[:16]


def onnx_inputs(model: Path) -> list[InputSpec]:
    """The model's inputs as ONNX Runtime reads them."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    specs = []
    for port in session.get_inputs():
        datatype = ORT_TYPES.get(port.type)
        if datatype is None:
            raise BenchError(f"input '{port.name}' is {port.type}: INT8 calibration takes numeric inputs")
        dims = tuple(d if isinstance(d, int) and d > 0 else -1 for d in port.shape)
        specs.append(InputSpec(port.name, datatype, dims))
    return specs


def _batched(specs: Sequence[InputSpec]) -> bool:
    return all(s.dims[:1] == (-1,) for s in specs) and bool(specs)


def _rows(feed: Feed, specs: Sequence[InputSpec], where: str) -> list[Feed]:
    """A sample as rows of batch 1 (or as it is for a model without a batch axis), shapes checked."""
    for spec in specs:
        if spec.name not in feed:
            raise BenchError(f"{where}: no data for input '{spec.name}' (has {', '.join(sorted(feed))})")
    batched = _batched(specs)
    fixed: Feed = {}
    for spec in specs:
        array = np.asarray(feed[spec.name])
        if batched and array.ndim == len(spec.dims) - 1:
            array = array[None]  # one item without its batch axis
        if array.ndim != len(spec.dims) or any(
            d > 0 and a != d for a, d in zip(array.shape, spec.dims, strict=True)
        ):
            raise BenchError(f"{where}: input '{spec.name}' {list(array.shape)} does not fit the model's "
                             f"{['?' if d < 0 else d for d in spec.dims]}")  # fmt: skip
        from edgeserve.protocol import datatypes

        fixed[spec.name] = np.ascontiguousarray(array, dtype=datatypes.numpy_dtype(spec.datatype))
    if not batched:
        return [fixed]
    count = {a.shape[0] for a in fixed.values()}
    if len(count) != 1:
        raise BenchError(f"{where}: the inputs' batch sizes differ ({sorted(count)})")
    return [{k: v[i : i + 1] for k, v in fixed.items()} for i in range(count.pop())]


def from_folder(folder: Path, specs: Sequence[InputSpec], limit: int) -> list[Feed]:
    if not folder.is_dir():
        raise BenchError(f"--calibration {folder}: not a folder")
    files = sorted(p for p in folder.rglob("*") if p.is_file() and not p.name.startswith("."))
    rows: list[Feed] = []
    for path in files:
        suffix = path.suffix.lower()
        if suffix in SAMPLE_SUFFIXES:
            feed = _numpy_file(path, specs)
            if feed is None:
                continue
        elif suffix in IMAGE_SUFFIXES and len(specs) == 1 and not any(d < 0 for d in specs[0].dims[1:]):
            spec = specs[0]
            shape = (1, *spec.dims[1:]) if _batched(specs) else spec.dims
            feed = {spec.name: load_file(path, TensorSpec(spec.name, spec.datatype, spec.dims), shape)}
        else:
            continue  # not a sample file for this model (README, labels ...)
        rows += _rows(feed, specs, str(path))
        if limit and len(rows) >= limit:
            break
    return rows[:limit] if limit else rows


def _numpy_file(path: Path, specs: Sequence[InputSpec]) -> Feed | None:
    """A .npy (one-input models) or .npz sample; never unpickled (a sample file cannot run code)."""
    try:
        if path.suffix.lower() == ".npy":
            return {specs[0].name: np.load(path, allow_pickle=False)} if len(specs) == 1 else None
        with np.load(path, allow_pickle=False) as data:
            feed = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError, EOFError) as exc:
        raise BenchError(f"calibration sample {path}: not a plain numeric array ({exc})") from None
    if len(specs) == 1 and len(feed) == 1:
        feed = {specs[0].name: next(iter(feed.values()))}
    return feed


def from_warmup(model_dir: Path, config: Any, specs: Sequence[InputSpec], limit: int, seed: int = 0
                ) -> tuple[list[Feed], bool]:  # fmt: skip
    """(rows, real): input_data_file samples as they are; random/zero data entries filled with seeded
    random values (up to RANDOM_ROWS rows, at least 2 per entry)."""
    from edgeserve.repository import warmup

    if config is None or not len(config.model_warmup):
        return [], False
    try:
        samples = warmup.samples(config, model_dir, str(model_dir / "config.pbtxt"), seed=seed)
    except Exception as exc:
        raise BenchError(f"model_warmup of {model_dir.name} is not usable: {exc}") from None
    rng = np.random.default_rng(seed)
    real: list[Feed] = []
    filled: list[Feed] = []
    for entry, sample in zip(config.model_warmup, samples, strict=False):
        rows = _rows(sample.inputs, specs, f"model_warmup '{entry.name}'")
        if {v.WhichOneof("input_data_type") for v in entry.inputs.values()} == {"input_data_file"}:
            real += rows
            continue
        wanted = max(2, RANDOM_ROWS // max(1, len(config.model_warmup)))
        filled += [{k: _random_like(v, rng) for k, v in rows[0].items()} for _ in range(wanted)]
    # the owner's data when there is some: random fill-ins of other entries would only dilute it
    rows = real or filled
    return (rows[:limit] if limit else rows), bool(real)


def _random_like(array: Array, rng: np.random.Generator) -> Array:
    if np.issubdtype(array.dtype, np.floating):
        return rng.random(array.shape).astype(array.dtype)
    if array.dtype == np.bool_:
        return rng.random(array.shape) < 0.5
    return rng.integers(0, 10, size=array.shape).astype(array.dtype)


def split(rows: list[Feed], holdout: float) -> tuple[list[Feed], list[Feed]]:
    """Every k-th row held out (k = round(1 / holdout)); at least one row on each side."""
    if len(rows) < 2:
        raise BenchError(
            f"INT8 calibration needs at least 2 samples (one calibrated on, one held out); found {len(rows)}"
        )
    k = max(2, round(1 / holdout)) if holdout > 0 else len(rows)
    held = [r for i, r in enumerate(rows) if i % k == k - 1] or rows[-1:]
    ids = {id(r) for r in held}
    return [r for r in rows if id(r) not in ids], held


def collect(
    model: Path, model_dir: Path, config: Any, source: str, folder: Path | None, limit: int,
    holdout: float,
) -> Samples:  # fmt: skip
    """The samples from the chosen source (see the module doc)."""
    if source not in SOURCES:
        raise BenchError(f"--calibration-source {source!r}: one of {', '.join(SOURCES)}")
    if source == "folder" and folder is None:
        raise BenchError("--calibration-source folder needs --calibration DIR")
    specs = onnx_inputs(model)
    order = [source] if source != "auto" else (["folder"] if folder else []) + ["bundle", "warmup"]
    tried = []
    for kind in order:
        real = True
        if kind == "folder":
            assert folder is not None
            rows, where = from_folder(folder, specs, limit), f"folder {folder}"
        elif kind == "bundle":
            rows = from_folder(model_dir / CALIBRATION_DIR, specs, limit) if (
                model_dir / CALIBRATION_DIR).is_dir() else []  # fmt: skip
            where = f"{model_dir.name}/{CALIBRATION_DIR}/"
        else:
            rows, real = from_warmup(model_dir, config, specs, limit)
            where = "model_warmup " + ("input_data_file data" if real else "shapes with random data")
        if rows:
            calibration, held_out = split(rows, holdout)
            return Samples(calibration, held_out, f"{where} ({len(rows)} rows)", real)
        tried.append(where)
    raise BenchError(
        f"no calibration samples for {model_dir.name} (tried {'; '.join(tried)}): give --calibration DIR "
        f"(.npy/.npz/images), ship {CALIBRATION_DIR}/ in the bundle, or add model_warmup to config.pbtxt"
    )


def batches(rows: Sequence[Feed], size: int, batched: bool) -> list[Feed]:
    """Rows regrouped into batches of `size` (the model's batch axis), for fewer calibration runs."""
    if not batched or size <= 1:
        return list(rows)
    out = []
    for start in range(0, len(rows), size):
        group = rows[start : start + size]
        out.append({k: np.concatenate([r[k] for r in group]) for k in group[0]})
    return out


class Reader:
    """onnxruntime.quantization's CalibrationDataReader over batches, with a progress line each."""

    def __init__(self, feeds: Sequence[Feed], say: Callable[[str], None]) -> None:
        self.feeds = list(feeds)
        self.say = say
        self.index = 0
        self.every = max(1, math.ceil(len(self.feeds) / 10))

    def get_next(self) -> Feed | None:
        if self.index >= len(self.feeds):
            return None
        feed = self.feeds[self.index]
        self.index += 1
        if self.index % self.every == 0 or self.index == len(self.feeds):
            self.say(f"  calibration batch {self.index}/{len(self.feeds)}")
        return feed

    def __iter__(self) -> Iterator[Feed]:
        while (feed := self.get_next()) is not None:
            yield feed

    def __len__(self) -> int:
        return len(self.feeds)

    def rewind(self) -> None:
        self.index = 0
