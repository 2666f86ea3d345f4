"""The MLServer peer's model class (imported by MLServer inside its venv, never by edgeserve's): an
`mlserver.MLModel` whose `load` builds an ONNX Runtime session with the options edgeserve's instance
uses (peer_ort.ort_session over the spec mlserver_peer.py wrote) and whose `predict` runs it.

MLServer's adaptive batching (model-settings `max_batch_size`, `max_batch_time`) hands `predict` the
requests stacked along the first axis and splits the outputs again, as edgeserve's dynamic batcher does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from peer_ort import ort_session


class OrtModel(MLModel):  # type: ignore[misc]
    async def load(self) -> bool:
        extra = self.settings.parameters.extra or {}
        self.spec: dict[str, Any] = json.loads(Path(extra["spec"]).read_text())
        self.session = ort_session(self.spec)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0]).astype(np.float32, copy=False)
        y = self.session.run([self.spec["output"]], {self.spec["input"]: x})[0]
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output(self.spec["output"], y)]
        )
