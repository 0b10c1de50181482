"""Task heads: data readers, features, decoding and metrics glue for fine-tuning and serving.

Inference-side API (pure functions on a fast tokenizer and numpy arrays; no torch model inside):

* :mod:`encoderkit.tasks.ner.features` -- ``featurize_text`` / ``featurize_words`` (sub-token windows with
  overlap, first-sub-token labels) and ``decode_entities`` (logits -> entities with char spans).
* :mod:`encoderkit.tasks.qa.features` -- ``featurize_qa`` (question + context windows with doc stride and
  char offsets) and ``decode_answers`` (n-best span search -> text, char start/end, score).
* :mod:`encoderkit.tasks.tags` -- IOB1 / IOB2 / BIOES conversions to IOB2 and spans.
"""

from __future__ import annotations

TASKS = ("classify", "ner", "qa", "rerank", "embed")

# task -> module with ``build(cfg, tokenizer, folder: ModelFolder) -> TaskRun`` and
# ``evaluate_folder(folder, tokenizer, data, cfg) -> metrics``
TASK_MODULES = {
    "classify": "encoderkit.tasks.classify.train",
    "ner": "encoderkit.tasks.ner.train",
    "qa": "encoderkit.tasks.qa.train",
    "rerank": "encoderkit.tasks.rerank.train",
    "embed": "encoderkit.tasks.embed.train",
}
