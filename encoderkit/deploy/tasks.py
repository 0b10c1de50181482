"""Kept only for :mod:`encoderkit.compress.stack`, which still asks for ``onnx_file``: every fact about a
model folder lives in :class:`encoderkit.models.folder.ModelFolder`. Remove this module when
stack.py reads ``ModelFolder.open(folder).onnx(int8)``."""

from __future__ import annotations

from pathlib import Path

from encoderkit.models.folder import ONNX_FP32, ONNX_INT8


def onnx_file(folder: str | Path, int8: bool) -> Path | None:
    """The exported ONNX graph in ``folder`` (INT8 or FP32), or None when the folder has none."""
    p = Path(folder) / (ONNX_INT8 if int8 else ONNX_FP32)
    return p if p.is_file() else None
