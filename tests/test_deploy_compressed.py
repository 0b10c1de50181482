"""Head-pruned and quantized folders (compression levers) load in the deploy layer: torch Predictor and ONNX export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from encoderkit.compress.packing import load_model
from tests.conftest import WORDS
from tests.deploy_models import make_task_model

TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 9)) for i in range(32)]


@pytest.fixture(scope="module")
def compressed(tmp_path_factory, tiny_tokenizer_dir) -> dict[str, Path]:
    """A tiny classifier, head-pruned (2 of 4 heads per layer) and GPTQ INT4-quantized (group 16)."""
    from encoderkit.compress.prune import PruneConfig, prune
    from encoderkit.compress.quantize import QuantizeConfig, quantize

    root = tmp_path_factory.mktemp("compressed")
    src = make_task_model(root, tiny_tokenizer_dir, "classify")
    prune(src, PruneConfig(method="heads", amount=0.5, importance="magnitude", measure=False), root / "heads")
    quantize(src, QuantizeConfig(method="gptq", bits=4, group_size=16, measure=False, calib_samples=32), root / "int4",
             calib=TEXTS)
    return {"heads": root / "heads", "int4": root / "int4"}


def _reference_probs(folder: Path) -> np.ndarray:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = load_model(folder)(**tok(TEXTS[:8], padding=True, truncation=True, return_tensors="pt")).logits
    return torch.softmax(logits, -1).numpy()


@pytest.mark.parametrize("kind", ["heads", "int4"])
def test_compressed_folder_serves_in_torch_and_exports_to_onnx(compressed, tmp_path, kind) -> None:
    from encoderkit.inference.export import ExportConfig, run
    from encoderkit.inference.predictor import Predictor

    folder = compressed[kind]
    ref = _reference_probs(folder)
    torch_pred = Predictor.load(folder, backend="torch-fp32")
    got = np.array([[r["scores"][lab] for lab in ("negative", "positive")] for r in torch_pred.classify(TEXTS[:8])])
    np.testing.assert_allclose(got, ref, atol=1e-5)

    res = run(ExportConfig(model=str(folder), out=str(tmp_path / "onnx")))
    assert res.parity["fp32_max_abs_diff"] < 1e-4  # the export's own parity check against the rebuilt model
    onnx_pred = Predictor.load(tmp_path / "onnx", backend="onnx-fp32")
    got = np.array([[r["scores"][lab] for lab in ("negative", "positive")] for r in onnx_pred.classify(TEXTS[:8])])
    np.testing.assert_allclose(got, ref, atol=1e-4)
    if kind == "heads":  # the graph really has the smaller attention: Q is (hidden, 2 heads * 8)
        assert load_model(folder).bert.encoder.layer[0].attention.self.query.weight.shape == (16, 32)
