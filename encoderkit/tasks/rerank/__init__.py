"""Cross-encoder reranking: ``data`` builds query groups, ``features`` makes and scores (query, passage) pairs, ``train`` wires listwise fine-tuning and evaluation."""


def __getattr__(name: str):
    """``TASK``, the task object (:mod:`encoderkit.tasks.rerank.task`), imported on first use: importing one of
    this package's modules (its features, say) does not import its training wiring."""
    if name == "TASK":
        from encoderkit.tasks.rerank.task import TASK

        return TASK
    raise AttributeError(name)
