"""NER fine-tuning and evaluation: ``AutoModelForTokenClassification`` over IOB2 labels, each window of a long
sentence one training row; scoring predicts per word and counts entities as seqeval does.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from transformers import AutoModelForTokenClassification

from encoderkit.errors import EncoderkitError
from encoderkit.metrics.scores import entity_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, run_batches, seeded_subset
from encoderkit.tasks.ner.data import Sentence, entity_types, read_ner
from encoderkit.tasks.ner.features import NerFeatures, decode_word_tags, featurize_words, window_logits, window_rows
from encoderkit.tasks.ner.options import NerOptions

OPTIONS = NerOptions


def label_list(types: list[str]) -> list[str]:
    """``O`` then ``B-X``, ``I-X`` for each type X in sorted order."""
    return ["O"] + [f"{p}-{t}" for t in types for p in ("B", "I")]


def featurize(tokenizer, sents: list[Sentence], options: NerOptions,
              label2id: dict[str, int] | None = None) -> list[NerFeatures]:
    feats = []
    for s in sents:
        ids = [label2id[t] for t in s.tags] if label2id is not None else None
        feats.append(featurize_words(tokenizer, s.words, max_length=options.max_length, stride=options.stride,
                                     label_ids=ids, text=s.text, word_spans=s.word_spans))
    return feats


def predict_tags(module, tokenizer, feats: list[NerFeatures], id2label: dict[int, str],
                 batch_size: int) -> list[list[str]]:
    """IOB2 tags per word of each sentence."""
    rows, where = window_rows(feats, with_labels=False)
    outs = run_batches(module, rows, tokenizer.pad_token_id, batch_size, lambda o: o.logits, per_token=True)
    logits = window_logits(feats, where, outs, outs[0].shape[-1] if outs else len(id2label))
    return [decode_word_tags(f, lg, id2label)[0] for f, lg in zip(feats, logits, strict=True)]


def _check_types(train_types: list[str], sents: list[Sentence], path: str) -> None:
    unseen = sorted(set(entity_types(sents)) - set(train_types))
    if unseen:
        first = next(s.where for s in sents if any(t[2:] in unseen for t in s.tags))
        raise EncoderkitError(
            f"{path}: entity type(s) {', '.join(unseen)} never occur in the training data (first at {first}); "
            "the head cannot predict them: fix the tags or add training sentences"
        )


def build(data: TrainData, options: NerOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    train = seeded_subset(read_ner(data.train, options.tag_scheme), data.max_train_examples, data.seed)
    types = entity_types(train)
    if not types:
        raise EncoderkitError(f"{data.train}: no entity in the training data; check the tag column (the last one)")
    labels = label_list(types)
    label2id = {t: i for i, t in enumerate(labels)}
    rows, _ = window_rows(featurize(tokenizer, train, options, label2id), with_labels=True)
    evaluate = None
    if data.dev:
        dev = seeded_subset(read_ner(data.dev, options.tag_scheme), data.max_dev_examples, data.seed)
        _check_types(types, dev, data.dev)
        dev_feats = featurize(tokenizer, dev, options)

        def evaluate(module) -> dict[str, float]:
            pred = predict_tags(module, tokenizer, dev_feats, dict(enumerate(labels)), data.eval_batch_size)
            return entity_scores([s.tags for s in dev], pred)

    model = folder.load(AutoModelForTokenClassification, num_labels=len(labels), id2label=dict(enumerate(labels)),
                        label2id=label2id)
    pad_id = tokenizer.pad_token_id
    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), data.batch_size,
                             lambda idx, epoch: encode_batch([rows[i] for i in idx], pad_id), seed=data.seed,
                             bucket=data.bucket)

    def loss_fn(module, batch):
        return module(**batch).loss, {}

    card = {"task": "ner", "labels": labels, "tag_scheme": "iob2", "max_length": options.max_length,
            "stride": options.stride, "word_split": "encoderkit.tasks.ner.features.split_words"}
    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "f1", "max"),
                   lambda m, folder: m.save_pretrained(folder), card, num_train=len(train))


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: NerOptions,
                    engine: Any = None) -> dict[str, float]:
    """Entity P/R/F1 on a CoNLL file; ``engine`` (default: the folder's torch model) computes the logits."""
    model = folder.load(task="ner") if engine is None else engine
    id2label = dict(enumerate(folder.labels))
    sents = seeded_subset(read_ner(data.data, options.tag_scheme), data.max_examples, data.seed)
    _check_types(sorted({t[2:] for t in id2label.values() if t != "O"}), sents, str(data.data))
    pred = predict_tags(model, tokenizer, featurize(tokenizer, sents, options), id2label, data.batch_size)
    return {**entity_scores([s.tags for s in sents], pred), "sentences": len(sents)}
