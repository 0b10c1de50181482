"""Task heads: one package per task, the same file names in each, so a task's reading, features and
training wiring are found from the folder names alone::

    tasks/<task>/                 classify, ner, qa, rerank, embed
        data.py                   reading the task's data files into examples
        features.py               examples -> token rows, model outputs -> predictions (numpy + a fast
                                  tokenizer; the model behind an injected engine): evaluate, the
                                  Predictor and compression use it
        options.py                the task's one frozen options class (only its own settings), built
                                  once from the parsed stage config: ``for_training`` / ``for_folder``
        train.py                  ``build(data, options, tokenizer, folder) -> TaskRun`` (fine-tuning
                                  wiring) and ``evaluate_folder(folder, tokenizer, data, options)``
    tasks/ (shared)               batching, common (TaskRun, TrainData, EvalData, pick), inference
                                  (engines), options (the flat task flags of finetune/evaluate),
                                  tabular (TSV/CSV/JSONL rows), labeled (``encoderkit label`` output),
                                  tags (IOB1/IOB2/BIOES)

rerank's and embed's ``data`` build training groups from triples JSONL or BEIR sources
(:mod:`encoderkit.retrieval.beir`, :mod:`encoderkit.retrieval.mining`); embed's ``features`` holds
the bi-encoder, whose pooling + normalisation is its "decoding".
"""

from __future__ import annotations

TASKS = ("classify", "ner", "qa", "rerank", "embed")

# task -> module with ``OPTIONS`` (its options class), ``build(data: TrainData, options, tokenizer,
# folder: ModelFolder) -> TaskRun`` and ``evaluate_folder(folder, tokenizer, data: EvalData, options) -> metrics``
TASK_MODULES = {
    "classify": "encoderkit.tasks.classify.train",
    "ner": "encoderkit.tasks.ner.train",
    "qa": "encoderkit.tasks.qa.train",
    "rerank": "encoderkit.tasks.rerank.train",
    "embed": "encoderkit.tasks.embed.train",
}
