"""The task flags shared by ``encoderkit finetune`` and ``encoderkit evaluate`` (both configs inherit them, so one
flag means one thing everywhere). Task code never reads a stage config: each task's frozen options class is built
from it once (:func:`encoderkit.tasks.common.pick`), with derived values worked out there.
"""

from __future__ import annotations

from dataclasses import dataclass

from encoderkit.config import StageConfig, arg
from encoderkit.models.pooling import AUTO, FLAG_CHOICES
from encoderkit.tasks import TASKS


@dataclass
class TaskDataOptions(StageConfig):
    """Data columns and feature settings for every task."""

    task: str = arg("classify", help="Task head to train or evaluate.", choices=TASKS)
    text_column: str = arg("auto", help=(
        "classify: column (TSV/CSV header or JSONL key) holding the text. 'auto': the column the model was "
        "fine-tuned on (evaluate), else one named text, sentence, content, review, document, body, comment, "
        "sentence1, question, tweet, utterance or title, else the only column of non-numeric text; the log says "
        "which."))
    text_pair_column: str = arg("", help="classify: column holding the second text of a pair (empty: single texts).")
    label_column: str = arg("label", help="classify: column holding the label.")
    multi_label: bool = arg(False, help="classify: several labels per row (BCE loss, threshold 0.5).")
    label_separator: str = arg(",", help="classify: separator between labels of a multi-label row.")
    max_length: int = arg(0, help=(
        "Sub-tokens per sequence (0: the task's default: classify 128, ner 128, qa 256, rerank 256, embed the "
        "sentence-transformers folder's max_seq_length or 256). classify/rerank/embed: longer texts are TRUNCATED. "
        "ner: longer sentences are split into overlapping windows (--stride), nothing is lost. "
        "qa: the context is split into windows overlapping by --doc-stride. evaluate: 0 keeps the length the "
        "model was fine-tuned with; a value overrides it."))
    stride: int = arg(0, help=(
        "ner: sub-tokens shared by consecutive windows of a long sentence. 0: 32 when training; evaluate takes the "
        "saved model's own, else 32 cut to a quarter of the window (what predict and serve use)."))
    tag_scheme: str = arg("auto", help="ner: tag scheme of CoNLL files, converted to IOB2.",
                          choices=("auto", "iob1", "iob2", "bioes"))
    doc_stride: int = arg(0, help="qa: sub-tokens shared by consecutive context windows (0: a quarter of "
                                  "--max-length).")
    max_answer_length: int = arg(30, help="qa: longest answer span in sub-tokens.")
    n_best: int = arg(20, help="qa: start and end candidates per window in the span search.")
    qa_split: str = arg("all", help=(
        "qa: which articles of a SQuAD file to use: 'train' (the first 80%% of articles in file order), "
        "'heldout' (the last 20%%) or 'all'. finetune with the same file as --train and --dev always "
        "trains on 'train' and evaluates on 'heldout'."), choices=("all", "train", "heldout"))
    max_query_length: int = arg(64, help="rerank/embed: sub-tokens per query (longer queries truncated).")
    pooling: str = arg(AUTO, help=(
        "embed/classify: 'mean' (of the real tokens) or 'first' (first token, [CLS]) pooling. 'auto': embed takes "
        "a sentence-transformers folder's own pooling, else mean; classify takes 'first', which is what plain "
        "transformers (AutoModelForSequenceClassification, pipeline) computes, unless the folder is already a "
        "mean-pooled classifier. classify 'mean' (BERT-style models or ModernBERT) is recorded in config.json and "
        "applied by encoderkit's evaluate/predict/serve/export, but plain transformers pools the first token of a "
        "BERT anyway and gives OTHER outputs: the log and the card (hf_compatible: false) warn about it. "
        "evaluate: an embed model is scored on embeddings pooled as asked ('auto': its own); a classifier "
        "(classify, rerank, multilabel) or a static embedding only with the pooling it records; other tasks refuse "
        "the flag."), choices=FLAG_CHOICES)
    candidates: int = arg(100, help="rerank on a BEIR source: the bi-encoder's top-K documents per query that the "
                                    "cross-encoder reorders.")
    seed: int = arg(0, help="Seed of the new head's initialisation, shuffling, subsets, negative sampling and dropout.")
