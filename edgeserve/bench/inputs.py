"""What a model takes, as the server describes it, and the request inputs the bench sends.

Shapes: the server's metadata gives each input's shape with -1 for dynamic dimensions (the batch
dimension first, for a model whose config batches). A dynamic dimension is filled from `--shape
NAME:d1,d2` (without the batch dimension for a batching model, as perf_analyzer's --shape), else from
the config's `model_warmup` entry for that input, else it is an error that says what to pass.

Data: random (seeded, 16 distinct samples), zeros, or files: `.npy` arrays (used as they are, a batch
dimension added when one is missing), raw files (the input's dtype, native byte order), and images
(resized to the input's height and width, NCHW or NHWC, uint8 as is, floats scaled to 0..1; needs
Pillow). A model with several inputs takes files named after an input (`x.npy`, `x_001.png`) or in a
folder named after it (`x/...`) for that input; inputs without files get random data.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from edgeserve.bench.errors import BenchError
from edgeserve.protocol import datatypes

IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm"}
)
RANDOM_SAMPLES = 16
Sample = dict[str, "npt.NDArray[Any]"]


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # as the server reports it, -1 = dynamic (batch dimension included)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    platform: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int | None  # None: the server gave no config
    warmup_dims: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def batched(self) -> bool:
        if self.max_batch_size is not None:
            return self.max_batch_size > 0
        return all(t.shape[:1] == (-1,) for t in self.inputs) and bool(self.inputs)


def _ints(values: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in values or ())


def model_info(metadata: Mapping[str, Any], config: Mapping[str, Any] | None, version: str = "") -> ModelInfo:
    """From KServe V2 model metadata JSON and (optionally) Triton's model config JSON."""

    def specs(key: str) -> tuple[TensorSpec, ...]:
        return tuple(
            TensorSpec(str(t["name"]), str(t["datatype"]), _ints(t.get("shape")))
            for t in metadata.get(key, [])
        )

    max_batch: int | None = None
    warmup: dict[str, tuple[int, ...]] = {}
    if config is not None:
        max_batch = int(config.get("max_batch_size", 0) or 0)
        for entry in config.get("model_warmup", []) or []:
            for name, value in (entry.get("inputs") or {}).items():
                dims = _ints(value.get("dims"))
                if dims and all(d > 0 for d in dims):
                    warmup.setdefault(str(name), dims)
    versions = [str(v) for v in metadata.get("versions", [])]
    return ModelInfo(
        name=str(metadata.get("name", "")),
        version=version or (versions[-1] if versions else ""),
        platform=str(metadata.get("platform", "")),
        inputs=specs("inputs"),
        outputs=specs("outputs"),
        max_batch_size=max_batch,
        warmup_dims=warmup,
    )


def parse_shape_flags(flags: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """`NAME:d1,d2,...` flags into {name: dims}."""
    shapes: dict[str, tuple[int, ...]] = {}
    for flag in flags:
        name, sep, dims = flag.rpartition(":")
        try:
            values = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            values = ()
        if not sep or not name or not values or any(d <= 0 for d in values):
            raise BenchError(f"--shape {flag!r}: expected NAME:d1,d2,... with positive dimensions")
        shapes[name] = values
    return shapes


def resolve_shapes(
    info: ModelInfo, batch_size: int, overrides: Mapping[str, tuple[int, ...]]
) -> dict[str, tuple[int, ...]]:
    """The full request shape of every input (batch dimension included where the model batches)."""
    unknown = set(overrides) - {t.name for t in info.inputs}
    if unknown:
        names = ", ".join(t.name for t in info.inputs)
        raise BenchError(
            f"--shape names {', '.join(sorted(unknown))}: model '{info.name}' has inputs {names}"
        )
    batched = info.batched
    if batch_size < 1:
        raise BenchError("--batch-size must be at least 1")
    if not batched and batch_size != 1:
        raise BenchError(f"model '{info.name}' does not batch (max_batch_size 0): --batch-size must be 1")
    if info.max_batch_size and batch_size > info.max_batch_size:
        raise BenchError(
            f"--batch-size {batch_size} is over model '{info.name}' max_batch_size {info.max_batch_size}"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    for spec in info.inputs:
        dims = spec.shape[1:] if batched else spec.shape
        given = overrides.get(spec.name) or (info.warmup_dims.get(spec.name) if -1 in dims else None)
        if given is not None:
            if len(given) != len(dims) or any(d not in (-1, g) for d, g in zip(dims, given, strict=True)):
                raise BenchError(f"shape {list(given)} does not fit input '{spec.name}' {list(dims)}")
            dims = given
        if -1 in dims:
            example = ",".join("1" if d == -1 else str(d) for d in dims)
            raise BenchError(
                f"input '{spec.name}' has dynamic dimensions {list(dims)}"
                + (" (batch dimension left out)" if batched else "")
                + f": give them with --shape {spec.name}:{example}"
            )
        shapes[spec.name] = ((batch_size,) if batched else ()) + tuple(dims)
    return shapes


def make_samples(
    info: ModelInfo, shapes: Mapping[str, tuple[int, ...]], data: Sequence[str], seed: int = 0
) -> list[Sample]:
    """The request inputs to cycle through: `data` is ["random"], ["zeros"] or files / folders."""
    rng = np.random.default_rng(seed)
    kinds = [d for d in data if d in ("random", "zeros")]
    if kinds and len(kinds) != len(data):
        raise BenchError("--input-data: give 'random', 'zeros' or files/folders, not a mix")
    if not data or kinds == ["random"]:
        return [
            {t.name: _random(rng, t.datatype, shapes[t.name]) for t in info.inputs}
            for _ in range(RANDOM_SAMPLES)
        ]
    if kinds == ["zeros"]:
        return [{t.name: _zeros(t.datatype, shapes[t.name]) for t in info.inputs}]
    if kinds:
        raise BenchError("--input-data: give one of 'random' or 'zeros'")
    files = _files(data)
    per_input: dict[str, list[npt.NDArray[Any]]] = {t.name: [] for t in info.inputs}
    names = [t.name for t in info.inputs]
    for path in files:
        target = names[0] if len(names) == 1 else _owner(path, names)
        if target is not None:
            spec = next(t for t in info.inputs if t.name == target)
            per_input[target].append(load_file(path, spec, shapes[target]))
    count = max((len(v) for v in per_input.values()), default=0)
    if count == 0:
        raise BenchError(f"--input-data: no usable files for inputs {', '.join(names)} in {', '.join(data)}")
    samples: list[Sample] = []
    for i in range(count):
        sample: Sample = {}
        for spec in info.inputs:
            arrays = per_input[spec.name]
            sample[spec.name] = (
                arrays[i % len(arrays)] if arrays else _random(rng, spec.datatype, shapes[spec.name])
            )
        samples.append(sample)
    return samples


def _owner(path: Path, names: Sequence[str]) -> str | None:
    for name in sorted(names, key=len, reverse=True):
        if path.parent.name == name or path.stem == name or path.stem.startswith(name + "_"):
            return name
    return None


def _files(data: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for item in data:
        path = Path(item)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
        elif path.is_file():
            files.append(path)
        else:
            raise BenchError(f"--input-data: {item} is not 'random', 'zeros', a file or a folder")
    return files


def _random(rng: np.random.Generator, datatype: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    if datatype == "BYTES":
        flat = [bytes(rng.integers(97, 123, 8, dtype=np.uint8)) for _ in range(math.prod(shape))]
        return np.array(flat, dtype=np.object_).reshape(shape)
    dtype = datatypes.numpy_dtype(datatype)
    if datatype == "BOOL":
        return rng.integers(0, 2, shape).astype(np.bool_)
    if np.issubdtype(dtype, np.integer):
        high = 256 if dtype == np.uint8 else 16  # small: integer inputs are often indices
        return rng.integers(0, high, shape).astype(dtype)
    return rng.random(shape, dtype=np.float32).astype(dtype)


def _zeros(datatype: str, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    if datatype == "BYTES":
        return np.full(shape, b"", dtype=np.object_)
    return np.zeros(shape, dtype=datatypes.numpy_dtype(datatype))


def load_file(path: Path, spec: TensorSpec, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    """One file as the input `spec` of full request shape `shape`."""
    dtype = None if spec.datatype == "BYTES" else datatypes.numpy_dtype(spec.datatype)
    suffix = path.suffix.lower()
    if suffix in IMAGE_SUFFIXES:
        return _image(path, spec, shape)
    if suffix == ".npy":
        try:
            array: npt.NDArray[Any] = np.asarray(np.load(path, allow_pickle=False))
        except (OSError, ValueError) as exc:
            raise BenchError(f"--input-data {path}: {exc}") from None
    else:
        if dtype is None:
            raise BenchError(f"--input-data {path}: BYTES input '{spec.name}' takes .npy files only")
        raw = path.read_bytes()
        if len(raw) % dtype.itemsize:
            raise BenchError(f"--input-data {path}: {len(raw)} bytes is not a whole number of {dtype} values")
        array = np.frombuffer(raw, dtype=dtype)
        if array.size == math.prod(shape):
            array = array.reshape(shape)
        elif shape and array.size == math.prod(shape[1:]):
            array = array.reshape(shape[1:])
    if dtype is not None and array.dtype != dtype:
        array = array.astype(dtype)
    if array.shape == shape:
        return array
    if tuple(array.shape) == shape[1:]:  # one item of a batch: repeat it
        return np.ascontiguousarray(np.broadcast_to(array, shape))
    raise BenchError(
        f"--input-data {path}: shape {list(array.shape)} does not fit input '{spec.name}' {list(shape)}"
    )


def _image(path: Path, spec: TensorSpec, shape: tuple[int, ...]) -> npt.NDArray[Any]:
    try:
        from PIL import Image
    except ImportError:
        raise BenchError(
            f"--input-data {path}: reading images needs Pillow (pip install pillow); "
            "or give .npy or raw files"
        ) from None
    if len(shape) < 3:
        raise BenchError(f"--input-data {path}: input '{spec.name}' {list(shape)} is not image-shaped")
    inner = shape[-3:]
    if inner[0] in (1, 3):
        channels, height, width, chw = inner[0], inner[1], inner[2], True
    elif inner[2] in (1, 3):
        height, width, channels, chw = inner[0], inner[1], inner[2], False
    else:
        raise BenchError(
            f"--input-data {path}: input '{spec.name}' {list(shape)} is neither NCHW nor NHWC "
            "with 1 or 3 channels"
        )
    try:
        with Image.open(path) as image:
            image = image.convert("L" if channels == 1 else "RGB").resize(
                (width, height), Image.Resampling.BILINEAR
            )
            pixels = np.asarray(image, dtype=np.uint8).reshape(height, width, channels)
    except OSError as exc:
        raise BenchError(f"--input-data {path}: {exc}") from None
    array: npt.NDArray[Any] = pixels.transpose(2, 0, 1) if chw else pixels
    dtype = datatypes.numpy_dtype(spec.datatype)
    array = array.astype(dtype) / 255.0 if np.issubdtype(dtype, np.floating) else array
    return np.ascontiguousarray(np.broadcast_to(array.astype(dtype), shape))
