"""The response half of a request: outputs cast to their declared type, classified where asked,
written into the client's output shared memory where asked; on the worker thread that ran the model,
so the event loop only encodes bytes.
"""

from __future__ import annotations

import logging
from typing import Any

from edgeserve.frontends.shm.registry import ShmLease
from edgeserve.protocol import datatypes
from edgeserve.protocol.errors import internal, invalid_arg
from edgeserve.protocol.inference import InferRequest, InferResponse, OutputTensor
from edgeserve.scheduling.job import Arrays
from edgeserve.server import validation
from edgeserve.server.contracts import ServedModelLike

log = logging.getLogger("edgeserve.dataplane")


class ResponseAssembler:
    """Builds a model's InferResponse; keeps the label files that classification reads."""

    def __init__(self) -> None:
        self._labels: dict[tuple[str, str], list[str] | None] = {}

    def response(
        self,
        request: InferRequest,
        served: ServedModelLike,
        outputs: Arrays,
        names: list[str],
        output_leases: dict[str, ShmLease],
    ) -> InferResponse:
        specs = validation.compiled(served.config).output_specs
        requested = {o.name: o for o in request.outputs} if request.outputs else {}
        response = InferResponse(
            model_name=served.name,
            model_version=str(served.version),
            id=request.id,
        )
        for name in names:
            if name not in outputs:
                raise internal(f"model '{served.name}' did not produce output '{name}'")
            array = outputs[name]
            spec = specs[name]
            datatype = spec.datatype
            if spec.dtype is not None and array.dtype != spec.dtype:
                array = array.astype(spec.dtype)
            wanted = requested.get(name)
            if wanted is not None and wanted.classification > 0:
                labels = self.labels_for(served, spec.label_filename)
                batched = served.config.max_batch_size > 0
                array = validation.classify(array, wanted.classification, labels, batched)
                datatype = "BYTES"
            if wanted is not None and wanted.shm is not None:
                _write_shm(name, array, datatype, output_leases[name])
                response.outputs.append(
                    OutputTensor(name, datatype, tuple(array.shape), None, shm=wanted.shm)
                )
            else:
                response.outputs.append(OutputTensor(name, datatype, tuple(array.shape), array))
        return response

    def labels_for(self, served: ServedModelLike, filename: str) -> list[str] | None:
        if not filename:
            return None
        # Keyed by folder: a reload from a new folder (a new bundle) reads its own labels. Bounded:
        # months of reloads must not grow it.
        key = (str(served.model_dir), filename)
        if key not in self._labels:
            if len(self._labels) >= 256:
                self._labels.clear()
            path = served.model_dir / filename
            try:
                self._labels[key] = path.read_text(encoding="utf-8").splitlines()
            except OSError:
                log.warning("label file %s of model %s is unreadable", path, served.name)
                self._labels[key] = None
        return self._labels[key]


def _write_shm(name: str, array: Any, datatype: str, lease: ShmLease) -> None:
    payload = datatypes.to_wire_bytes(array, datatype)
    size = memoryview(payload).nbytes
    capacity = lease.nbytes
    if size > capacity:
        raise invalid_arg(
            f"shared memory size specified with the request for output '{name}' ({capacity} bytes) "
            f"should be at least {size} bytes to hold the results"
        )
    lease.write(payload, f"output '{name}'")
