"""Representative inputs for the accuracy guard and the load-time race, from what the model ships.

In order of preference:
1. the OTA bundle's `checks` for this model (real requests the fleet vouches for), when the model
   is served from an installed bundle (`<bundle>/models/<model>/` beside `<bundle>/manifest.json`);
2. the config's `model_warmup` samples (Triton): `input_data_file` data as it is; `random_data` and
   `zero_data` give the real shapes (batch size, image size) and are filled with deterministic random
   values (zeros say nothing about accuracy);
3. nothing: the caller falls back to deterministic random inputs on the model's own shapes.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger("edgeserve.hardware.inputs")

Array = npt.NDArray[Any]
Feeds = list[dict[str, Array]]
MIN_SAMPLES = 3  # random-filled samples are repeated with other seeds up to this many


@dataclass(frozen=True)
class ModelInputs:
    feeds: Feeds
    source: str  # e.g. "2 OTA bundle checks", "model_warmup 'image_640x640' (random data, 3 samples)"
    real: bool  # True: data the model's owner supplied (bundle checks, warm-up files)

    def digest(self) -> str:
        """A short hash of the data, so a cache entry measured on other inputs is not reused."""
        h = hashlib.sha256()
        for feed in self.feeds:
            for name in sorted(feed):
                array = np.ascontiguousarray(feed[name])
                h.update(f"{name}|{array.dtype.str}|{array.shape}".encode())
                if array.dtype != np.object_:
                    h.update(array.tobytes())
        return h.hexdigest()[:16]


def _bundle_checks(name: str, model_dir: Path) -> ModelInputs | None:
    if model_dir.parent.name != "models":
        return None
    manifest = model_dir.parent.parent / "manifest.json"
    if not manifest.is_file():
        return None
    from edgeserve.protocol import datatypes

    try:
        data = json.loads(manifest.read_text())
        checks = [c for c in data.get("checks") or [] if isinstance(c, dict) and c.get("model") == name]
        feeds: Feeds = []
        for check in checks:
            feed: dict[str, Array] = {}
            for tensor in check["inputs"]:
                dtype = datatypes.numpy_dtype(str(tensor["datatype"]))
                shape = tuple(int(d) for d in tensor["shape"])
                feed[str(tensor["name"])] = np.asarray(tensor["data"], dtype=dtype).reshape(shape)
            feeds.append(feed)
    except Exception as exc:  # a bundle's checks are verified at install; a surprise must not fail a load
        log.warning("model %s: cannot read the bundle's checks from %s: %s", name, manifest, exc)
        return None
    if not feeds:
        return None
    return ModelInputs(feeds, f"{len(feeds)} OTA bundle check(s)", True)


def _warmup(model_dir: Path, config: Any, where: str, seed: int) -> ModelInputs | None:
    if config is None or not len(getattr(config, "model_warmup", ())):
        return None
    from edgeserve.repository import warmup

    try:
        samples = warmup.samples(config, model_dir, where, seed=seed)
    except Exception as exc:  # the load's own warm-up reports a bad sample; here it just is not used
        log.info("%s: model_warmup not usable as accuracy inputs: %s", where, exc)
        return None
    rng = np.random.default_rng(seed)
    feeds: Feeds = []
    files = False
    for entry, sample in zip(config.model_warmup, samples, strict=False):
        feed: dict[str, Array] = {}
        for input_name, array in sample.inputs.items():
            spec = entry.inputs.get(input_name) if hasattr(entry, "inputs") else None
            from_file = spec is not None and spec.WhichOneof("input_data_type") == "input_data_file"
            files = files or from_file
            feed[input_name] = array if from_file or array.dtype == np.object_ else _random_like(array, rng)
        feeds.append(feed)
    if not feeds:
        return None
    names = ", ".join(f"'{s.name}'" for s in samples)
    if not files:
        base = list(feeds)
        while len(feeds) < MIN_SAMPLES:
            feeds.append({k: _random_like(v, rng) for k, v in base[len(feeds) % len(base)].items()})
    kind = "warm-up files" if files else "random data"
    return ModelInputs(feeds, f"model_warmup {names} ({kind}, {len(feeds)} samples)", files)


def _random_like(array: Array, rng: np.random.Generator) -> Array:
    """Deterministic random values of the array's shape and type (as accuracy.sample_feeds)."""
    if array.dtype == np.bool_:
        return rng.random(array.shape) < 0.5
    if np.issubdtype(array.dtype, np.integer):
        return rng.integers(0, 8, size=array.shape).astype(array.dtype)
    return rng.random(array.shape).astype(array.dtype)


def model_inputs(
    name: str, model_dir: Path, config: Any, where: str = "", seed: int = 0
) -> ModelInputs | None:
    """The best inputs the model ships (see the module doc), or None for random ones."""
    return _bundle_checks(name, model_dir) or _warmup(model_dir, config, where or str(model_dir), seed)
