"""Retrieval: the local search index, an application of the embed (and rerank) task through the Predictor.

``index`` builds it (``encoderkit index``), ``search`` queries it (``encoderkit search`` and the Python API), ``http``
and ``page`` serve it under ``encoderkit serve --index``. What tasks train and score with lives below: BEIR reading
(:mod:`encoderkit.data.beir`), ranking metrics (:mod:`encoderkit.metrics.ranking`), exact search and mining (the
embed task).
"""
