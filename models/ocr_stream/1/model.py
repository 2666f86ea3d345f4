"""OCR streamed line by line (a decoupled Triton Python model calling the pipeline's models by BLS).

For a frame: ocr_pre -> ppocr_det -> ocr_boxes find the text boxes (in reading order); then for each
box ppocr_cls -> ocr_rotate -> ppocr_rec -> ocr_decode read it, and the line is sent at once as one
response (TEXT [1], BOXES [1, 4, 2], SCORES [1]: the `ocr` ensemble's outputs for that line). A line
ocr_decode drops (score under its text_score) sends nothing. Then the final flag alone. The same
models and crops as the ensemble, so the same lines; the recognizer sees one crop at a time instead
of a batch (it pads to the widest crop of the frame, as in the ensemble).

A cancelled request (the client left, cancelled its stream, or its deadline ended) stops at the next
line; a failed step ends the stream with that step's error.
"""

from __future__ import annotations

from typing import Any

import numpy as np

DET_OUTPUT = "sigmoid_0.tmp_0"
CLS_OUTPUT = "save_infer_model/scale_0.tmp_1"
REC_OUTPUT = "softmax_11.tmp_0"


class StepFailed(Exception):
    pass


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        import triton_python_backend_utils as pb_utils

        self.pb = pb_utils

    async def execute(self, requests: list[Any]) -> None:
        pb = self.pb
        for request in requests:
            sender = request.get_response_sender()
            try:
                await self.read(request, sender)
            except StepFailed as exc:
                sender.send(
                    pb.InferenceResponse(error=pb.TritonError(str(exc))),
                    flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL,
                )
                continue
            sender.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    async def step(self, model: str, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        pb = self.pb
        call = pb.InferenceRequest(
            model_name=model,
            requested_output_names=outputs,
            inputs=[pb.Tensor(name, array) for name, array in inputs.items()],
        )
        response = await call.async_exec()
        if response.has_error():
            raise StepFailed(f"ocr_stream step '{model}': {response.error().message()}")
        return [pb.get_output_tensor_by_name(response, name).as_numpy() for name in outputs]

    async def read(self, request: Any, sender: Any) -> None:
        pb = self.pb
        image = pb.get_input_tensor_by_name(request, "IMAGE").as_numpy()
        det_input, shape = await self.step("ocr_pre", {"IMAGE": image}, ["DET_INPUT", "SHAPE"])
        (prob,) = await self.step("ppocr_det", {"x": det_input}, [DET_OUTPUT])
        boxes, cls_crops, rec_crops, widths = await self.step(
            "ocr_boxes",
            {"PROB": prob, "IMAGE": image, "SHAPE": shape},
            ["BOXES", "CLS_CROPS", "REC_CROPS", "REC_WIDTHS"],
        )
        for i in range(len(boxes)):
            if request.is_cancelled():
                return
            line = slice(i, i + 1)
            (cls_probs,) = await self.step("ppocr_cls", {"x": cls_crops[line]}, [CLS_OUTPUT])
            (rec_input,) = await self.step(
                "ocr_rotate",
                {"REC_CROPS": rec_crops[line], "REC_WIDTHS": widths[line], "CLS_PROBS": cls_probs},
                ["REC_INPUT"],
            )
            (rec_probs,) = await self.step("ppocr_rec", {"x": rec_input}, [REC_OUTPUT])
            text, box, score = await self.step(
                "ocr_decode", {"REC_PROBS": rec_probs, "BOXES": boxes[line]}, ["TEXT", "BOXES_OUT", "SCORES"]
            )
            if len(text):
                sender.send(
                    pb.InferenceResponse(
                        [pb.Tensor("TEXT", text), pb.Tensor("BOXES", box), pb.Tensor("SCORES", score)]
                    )
                )
