"""How to run one model on this box: no numpy or runtime import, so the supervisor can plan budgets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

# BackendOptions.parameters key set when the model config names the backend itself: a backend may then
# accept trade-offs (e.g. OpenVINO's 32-bit INT64) it would otherwise refuse so that a fallback runs it.
PINNED_PARAMETER = "pinned_backend"

# A batch running longer than this marks its instance hung (answered, replaced); the model config's
# parameter `hang_timeout_s` overrides it per model (repository/served.py). The schedulers watch it, and
# a backend that runs models out of process (python/) bounds its waits by it.
DEFAULT_HANG_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class BackendOptions:
    """How to run one model on this box; filled from the runtime plan (hardware/) and the model config."""

    device: str = "CPU"  # CPU | GPU[:n] | NPU | AUTO | DLA:n
    precision: str = "fp32"  # fp32 | fp16 | bf16 | int8 | auto
    threads: int = 0  # intra-op threads; 0 = runtime default
    providers: tuple[str, ...] = ()  # ONNX Runtime execution providers, in preference order
    performance_hint: str = "LATENCY"  # OpenVINO: LATENCY | THROUGHPUT
    cache_dir: Path | None = None  # compiled-model / engine cache
    parameters: Mapping[str, str] = field(default_factory=dict)  # config.parameters passthrough
    # The model's files came with a load request (set by the repository from how the load was asked
    # for, repository/origin.py): a backend runs no code and loads no native library or engine from them.
    from_load_request: bool = False
