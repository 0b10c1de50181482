"""Inference: engines (ONNX Runtime, torch) and the one rule that picks and opens one for a model folder
(:mod:`encoderkit.inference.engines`), and the Predictor over them (:mod:`encoderkit.inference.predictor`).
Same layer as train, deploy and evaluate; deploy keeps export and the service."""
