"""`edgeserve samples` prepares what the OCR pipeline needs beyond the PP-OCR models: the rec model's
dictionary (from its ONNX metadata) for ocr_decode, and the ensemble's empty version folder."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx_models import build_identity

from edgeserve.samples import OCR_KEYS, extract_dictionary, prepare_ocr


def _rec_with_dictionary(path: Path, characters: str | None) -> Path:
    build_identity(path)
    if characters is not None:
        model = onnx.load(str(path))
        entry = model.metadata_props.add()
        entry.key, entry.value = "character", characters
        onnx.save(model, str(path))
    return path


def test_prepare_ocr_writes_the_dictionary_and_the_version_folder(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    _rec_with_dictionary(repo / "ppocr_rec" / "1" / "model.onnx", "a\nb\n中\n")
    (repo / "ocr_decode" / "1").mkdir(parents=True)
    (repo / "ocr").mkdir()
    prepare_ocr(repo)
    assert (repo / OCR_KEYS).read_text(encoding="utf-8") == "a\nb\n中\n"
    assert (repo / "ocr" / "1").is_dir()
    (repo / OCR_KEYS).write_text("kept\n", encoding="utf-8")
    prepare_ocr(repo)  # idempotent: an existing dictionary is left alone
    assert (repo / OCR_KEYS).read_text(encoding="utf-8") == "kept\n"


def test_a_repository_without_the_pipeline_is_left_alone(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    _rec_with_dictionary(repo / "ppocr_rec" / "1" / "model.onnx", "a\n")
    prepare_ocr(repo)
    assert sorted(p.name for p in repo.iterdir()) == ["ppocr_rec"]


def test_a_model_without_a_dictionary_is_refused(tmp_path: Path) -> None:
    rec = _rec_with_dictionary(tmp_path / "model.onnx", None)
    with pytest.raises(RuntimeError, match="no 'character' metadata"):
        extract_dictionary(rec, tmp_path / "keys.txt")
