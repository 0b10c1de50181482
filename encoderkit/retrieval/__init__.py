"""Retrieval: the one home of BEIR data, exact search, negative mining, retrieval metrics and the
local search index.

Below the tasks (importable by tasks' training and evaluation): ``beir`` (BEIR folders, the
SciFact export, triples), ``metrics`` (nDCG/MRR/recall, reciprocal-rank fusion), ``exact`` (exact
top-k, the bi-encoder run over a BEIR source), ``mining`` (hard negatives).
Above deploy (through the Predictor): ``corpus``, ``codes``, ``store``, ``ann``, ``index``
(``encoderkit index``), ``search`` (``encoderkit search`` and the Python API), ``calibrate``,
``milvus``, ``http`` (``/v1/search``). deploy/runtime never imports retrieval; deploy/serve only
registers the route when ``--index`` is given.
"""
