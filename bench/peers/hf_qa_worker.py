"""The HF Trainer side of bench/quality_qa.py: extractive QA the way transformers' examples/pytorch/question-answering
(run_qa.py + utils_qa.py) does it, in the peers' own venv (never imports encoderkit).

AutoModelForQuestionAnswering; ``prepare_train_features`` / ``prepare_validation_features`` (windows of
``max_length`` with ``doc_stride`` overlap, padded to max_length as run_qa's default, the first answer's sub-token
span or the [CLS] index when it is not fully inside a window); ``Trainer`` with TrainingArguments' own defaults but
the shared settings (epochs, batch, seed); ``postprocess_qa_predictions`` (n_best 20, max_answer_length 30); the
official SQuAD v1.1 EM/F1 (its normalisation re-implemented here, since ``evaluate.load("squad")`` needs the Hub).

The job (JSON on stdin): model, train (a SQuAD JSON file), heldout (one), seed, epochs, batch_size, max_length,
doc_stride, threads, out (a scratch folder). The result (JSON on the last stdout line): exact_match, f1 (fractions),
train_seconds (feature preparation, model load, Trainer construction, ``train()`` and ``save_model``),
eval_seconds, windows, predictions {id: text}.
"""

from __future__ import annotations

import collections
import json
import re
import string
import sys
import time
from collections import Counter

import numpy as np


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def read_squad(path: str) -> dict[str, list]:
    """A SQuAD JSON file as run_qa's columns (id, title, context, question, answers {text, answer_start})."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)["data"]
    cols: dict[str, list] = {"id": [], "title": [], "context": [], "question": [], "answers": []}
    for article in data:
        for para in article["paragraphs"]:
            for qa in para["qas"]:
                cols["id"].append(qa["id"])
                cols["title"].append(article.get("title", ""))
                cols["context"].append(para["context"])
                cols["question"].append(qa["question"])
                cols["answers"].append({"text": [a["text"] for a in qa["answers"]],
                                        "answer_start": [a["answer_start"] for a in qa["answers"]]})
    return cols


# -- the official SQuAD v1.1 evaluation (evaluate-v1.1.py) ---------------------------------------------------------

def normalize_answer(s: str) -> str:
    def remove_articles(text):
        return re.sub(r"\b(a|an|the)\b", " ", text)

    def white_space_fix(text):
        return " ".join(text.split())

    def remove_punc(text):
        exclude = set(string.punctuation)
        return "".join(ch for ch in text if ch not in exclude)

    return white_space_fix(remove_articles(remove_punc(s.lower())))


def f1_score(prediction: str, ground_truth: str) -> float:
    prediction_tokens = normalize_answer(prediction).split()
    ground_truth_tokens = normalize_answer(ground_truth).split()
    common = Counter(prediction_tokens) & Counter(ground_truth_tokens)
    num_same = sum(common.values())
    if num_same == 0:
        return 0
    precision = 1.0 * num_same / len(prediction_tokens)
    recall = 1.0 * num_same / len(ground_truth_tokens)
    return (2 * precision * recall) / (precision + recall)


def exact_match_score(prediction: str, ground_truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(ground_truth))


def squad_metric(predictions: dict[str, str], answers: dict[str, list[str]]) -> dict[str, float]:
    em = [max(exact_match_score(predictions[i], g) for g in gs) for i, gs in answers.items()]
    f1 = [max(f1_score(predictions[i], g) for g in gs) for i, gs in answers.items()]
    return {"exact_match": float(np.mean(em)), "f1": float(np.mean(f1))}


# -- utils_qa.postprocess_qa_predictions (SQuAD v1: no null answer) --------------------------------------------------

def postprocess_qa_predictions(examples, features, start_all, end_all, n_best_size=20, max_answer_length=30):
    example_id_to_index = {k: i for i, k in enumerate(examples["id"])}
    features_per_example = collections.defaultdict(list)
    for i, feature in enumerate(features):
        features_per_example[example_id_to_index[feature["example_id"]]].append(i)
    all_predictions = collections.OrderedDict()
    for example_index, example in enumerate(examples):
        prelim_predictions = []
        for feature_index in features_per_example[example_index]:
            start_logits = start_all[feature_index]
            end_logits = end_all[feature_index]
            offset_mapping = features[feature_index]["offset_mapping"]
            start_indexes = np.argsort(start_logits)[-1 : -n_best_size - 1 : -1].tolist()
            end_indexes = np.argsort(end_logits)[-1 : -n_best_size - 1 : -1].tolist()
            for start_index in start_indexes:
                for end_index in end_indexes:
                    if (start_index >= len(offset_mapping) or end_index >= len(offset_mapping)
                            or offset_mapping[start_index] is None or len(offset_mapping[start_index]) < 2
                            or offset_mapping[end_index] is None or len(offset_mapping[end_index]) < 2):
                        continue
                    if end_index < start_index or end_index - start_index + 1 > max_answer_length:
                        continue
                    prelim_predictions.append({
                        "offsets": (offset_mapping[start_index][0], offset_mapping[end_index][1]),
                        "score": start_logits[start_index] + end_logits[end_index]})
        predictions = sorted(prelim_predictions, key=lambda x: x["score"], reverse=True)[:n_best_size]
        context = example["context"]
        for pred in predictions:
            offsets = pred.pop("offsets")
            pred["text"] = context[offsets[0] : offsets[1]]
        if len(predictions) == 0 or (len(predictions) == 1 and predictions[0]["text"] == ""):
            predictions.insert(0, {"text": "empty", "score": 0.0})
        all_predictions[example["id"]] = predictions[0]["text"]
    return all_predictions


def main() -> None:
    job = json.loads(sys.stdin.read())
    import torch

    torch.set_num_threads(int(job["threads"]))
    from datasets import Dataset
    from transformers import (
        AutoModelForQuestionAnswering,
        AutoTokenizer,
        Trainer,
        TrainingArguments,
        default_data_collator,
    )

    max_seq_length, doc_stride = int(job["max_length"]), int(job["doc_stride"])
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    pad_on_right = tokenizer.padding_side == "right"
    train_examples = Dataset.from_dict(read_squad(job["train"]))
    column_names = train_examples.column_names

    def windows(examples):
        """run_qa's tokenisation of both feature kinds: (the windows of ``max_length`` with ``doc_stride`` overlap,
        each window's example index); the questions' leading spaces stripped in ``examples``."""
        examples["question"] = [q.lstrip() for q in examples["question"]]
        tokenized = tokenizer(
            examples["question" if pad_on_right else "context"], examples["context" if pad_on_right else "question"],
            truncation="only_second" if pad_on_right else "only_first", max_length=max_seq_length,
            stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True, padding="max_length")
        return tokenized, tokenized.pop("overflow_to_sample_mapping")

    def prepare_train_features(examples):
        tokenized, sample_mapping = windows(examples)
        offset_mapping = tokenized.pop("offset_mapping")
        tokenized["start_positions"], tokenized["end_positions"] = [], []
        for i, offsets in enumerate(offset_mapping):
            input_ids = tokenized["input_ids"][i]
            cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
            sequence_ids = tokenized.sequence_ids(i)
            answers = examples["answers"][sample_mapping[i]]
            if len(answers["answer_start"]) == 0:
                tokenized["start_positions"].append(cls_index)
                tokenized["end_positions"].append(cls_index)
                continue
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            token_start_index = 0
            while sequence_ids[token_start_index] != (1 if pad_on_right else 0):
                token_start_index += 1
            token_end_index = len(input_ids) - 1
            while sequence_ids[token_end_index] != (1 if pad_on_right else 0):
                token_end_index -= 1
            if not (offsets[token_start_index][0] <= start_char and offsets[token_end_index][1] >= end_char):
                tokenized["start_positions"].append(cls_index)
                tokenized["end_positions"].append(cls_index)
            else:
                while token_start_index < len(offsets) and offsets[token_start_index][0] <= start_char:
                    token_start_index += 1
                tokenized["start_positions"].append(token_start_index - 1)
                while offsets[token_end_index][1] >= end_char:
                    token_end_index -= 1
                tokenized["end_positions"].append(token_end_index + 1)
        return tokenized

    train_dataset = train_examples.map(prepare_train_features, batched=True, remove_columns=column_names)
    model = AutoModelForQuestionAnswering.from_pretrained(job["model"])
    args = TrainingArguments(output_dir=job["out"], per_device_train_batch_size=int(job["batch_size"]),
                             per_device_eval_batch_size=64, num_train_epochs=float(job["epochs"]),
                             seed=int(job["seed"]), save_strategy="no", report_to=[], use_cpu=True,
                             logging_steps=50, disable_tqdm=True,
                             **({"learning_rate": float(job["lr"])} if job.get("lr") else {}))  # controlled runs
    trainer = Trainer(model=model, args=args, train_dataset=train_dataset, data_collator=default_data_collator,
                      processing_class=tokenizer)
    train_result = trainer.train()
    trainer.save_model()
    train_seconds = time.perf_counter() - t0
    log(f"trained {len(train_dataset)} windows in {train_seconds:.1f}s: {train_result.metrics}")

    t1 = time.perf_counter()
    eval_examples = Dataset.from_dict(read_squad(job["heldout"]))

    def prepare_validation_features(examples):
        tokenized, sample_mapping = windows(examples)
        tokenized["example_id"] = []
        for i in range(len(tokenized["input_ids"])):
            sequence_ids = tokenized.sequence_ids(i)
            context_index = 1 if pad_on_right else 0
            tokenized["example_id"].append(examples["id"][sample_mapping[i]])
            tokenized["offset_mapping"][i] = [o if sequence_ids[k] == context_index else None
                                              for k, o in enumerate(tokenized["offset_mapping"][i])]
        return tokenized

    eval_features = eval_examples.map(prepare_validation_features, batched=True, remove_columns=column_names)
    output = trainer.predict(eval_features.remove_columns(["example_id", "offset_mapping"]))
    start_logits, end_logits = output.predictions
    predictions = postprocess_qa_predictions(eval_examples, eval_features, start_logits, end_logits,
                                             n_best_size=20, max_answer_length=30)
    metric = squad_metric(predictions, dict(zip(eval_examples["id"], (a["text"] for a in eval_examples["answers"]),
                                                strict=True)))
    eval_seconds = time.perf_counter() - t1
    log(f"heldout {metric} in {eval_seconds:.1f}s")
    print(json.dumps({**metric, "train_seconds": train_seconds, "eval_seconds": eval_seconds,
                      "windows": len(train_dataset), "predictions": dict(predictions)}))


if __name__ == "__main__":
    main()
