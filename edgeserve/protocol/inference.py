"""The frontend-neutral request and response that every transport decodes into and encodes from.

Frontends only translate wire formats into these objects; the data plane does everything else
(validation, shared-memory resolution, scheduling, classification, writing outputs into shm).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

ParamValue = bool | int | float | str


class RegionNamer(Protocol):
    """Who names the shared-memory regions of a request (frontends.shm.binding.ShmClient): regions
    are found by the principal that registered them and the socket (`owner`) it used."""

    @property
    def owner(self) -> str: ...

    @property
    def principal(self) -> str: ...


# Request timeouts longer than this (~12.7 days) mean "no deadline" in practice; they are clamped to
# it so that a client's UINT64_MAX never overflows a clock or a wait (threading's limit is ~292 years
# in seconds, a nanosecond deadline overflows int64 sooner).
MAX_TIMEOUT_US = 2**40


def clamp_timeout_us(value: int) -> int:
    """A client's request timeout in microseconds, clamped to MAX_TIMEOUT_US (0 = the model default)."""
    return min(int(value), MAX_TIMEOUT_US)


@dataclass(slots=True, frozen=True)
class ShmRef:
    """A tensor that lives in a registered shared-memory region (Triton system shm or an edgeserve ring)."""

    region: str
    byte_size: int
    offset: int = 0


@dataclass(slots=True)
class InputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    # A numpy view into the wire buffer (HTTP body, gRPC bytes, ZMQ frame); None when `shm` is set,
    # in which case the data plane fills it with a view into the mapped region.
    data: npt.NDArray[Any] | None = None
    shm: ShmRef | None = None
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(slots=True)
class RequestedOutput:
    name: str
    shm: ShmRef | None = None
    classification: int = 0  # top-N classification, 0 = raw tensor
    binary: bool | None = None  # HTTP binary_data flag; None = frontend default
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    model_name: str
    model_version: str = ""  # "" = the policy's latest ready version
    id: str = ""
    inputs: list[InputTensor] = field(default_factory=list)
    outputs: list[RequestedOutput] | None = None  # None = every output of the model
    parameters: dict[str, ParamValue] = field(default_factory=dict)
    priority: int = 0  # 0 = the model's default level, 1 = highest
    timeout_us: int = 0  # 0 = the model's queue policy default
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    shm_client: RegionNamer | None = None  # who names its shm regions (None: in-process); set by frontends


@dataclass(slots=True)
class OutputTensor:
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: npt.NDArray[Any] | None  # None when the output was written into shared memory
    shm: ShmRef | None = None
    parameters: dict[str, ParamValue] = field(default_factory=dict)


@dataclass(slots=True)
class InferResponse:
    model_name: str
    model_version: str
    id: str
    outputs: list[OutputTensor] = field(default_factory=list)
    parameters: dict[str, ParamValue] = field(default_factory=dict)

    def output(self, name: str) -> OutputTensor:
        for out in self.outputs:
            if out.name == name:
                return out
        raise KeyError(name)

    def as_numpy(self, name: str) -> npt.NDArray[Any]:
        data = self.output(name).data
        if data is None:
            raise KeyError(f"output '{name}' was written to shared memory")
        return np.asarray(data)
