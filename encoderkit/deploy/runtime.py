"""Old home of the Predictor, kept one release for old imports: it moved to :mod:`encoderkit.inference.predictor`
(its engines to :mod:`encoderkit.inference.engines`). Import from there; this module goes in the next release."""

from __future__ import annotations

from encoderkit.inference.engines import cached_export
from encoderkit.inference.predictor import (
    BACKENDS,
    OUTPUTS,
    PredictConfig,
    Predictor,
    PredictResult,
    describe,
    finish_embeddings,
    predict_records,
    read_records,
    run,
)

__all__ = ["BACKENDS", "OUTPUTS", "PredictConfig", "PredictResult", "Predictor", "cached_export",
           "describe", "finish_embeddings", "predict_records", "read_records", "run"]
