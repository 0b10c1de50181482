"""Retrieval: the local search index, an application of the embed (and rerank) task through the Predictor.

``corpus``, ``codes``, ``store``, ``ann``, ``index`` (``encoderkit index``), ``search`` (``encoderkit search``
and the Python API), ``calibrate``, ``milvus``, ``http`` (``/v1/search``). What tasks train and score with
lives below them: BEIR reading in :mod:`encoderkit.data.beir`, nDCG/MRR/recall and reciprocal-rank fusion in
:mod:`encoderkit.metrics.ranking`, exact search and hard-negative mining in the embed task
(:mod:`encoderkit.tasks.embed.exact`, :mod:`encoderkit.tasks.embed.mining`). the Predictor (inference/) never
imports retrieval; deploy/serve only registers the route when ``--index`` is given.
"""
