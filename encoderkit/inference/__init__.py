"""Inference: engines (:mod:`.engines`), the one policy that picks one for a model folder (:mod:`.policy`), ONNX
export (:mod:`.export`) and the Predictor over them (:mod:`.predictor`)."""
