"""The sentence-transformers side of bench/quality_embed.py and bench/quality_rerank.py: one training job, read as
JSON on stdin, its result printed as JSON on the last stdout line (logs go to stderr). Runs in the peers' venv
(/work/venvs/trainers); never imports encoderkit.

Job keys: ``kind`` (``embed`` or ``rerank``), ``model`` (the base folder), ``out`` (where the trained model is
saved), ``pairs`` ([[query, positive], ...], the training pairs both sides share), ``corpus`` (the texts negatives
are mined from), ``num_negatives`` (embed: 0 = in-batch negatives only), ``seed``, ``epochs``, ``batch_size``,
``max_length``, ``threads``.

embed: SentenceTransformerTrainer + MultipleNegativesRankingLoss (its defaults: scale 20, cosine), batches without
duplicate texts (BatchSamplers.NO_DUPLICATES, as its MNRL docs advise), the trainer's default optimiser settings
(lr 5e-5, linear decay, no warmup, no weight decay). With ``num_negatives``: ``util.mine_hard_negatives`` as its
docs show it (range_min=10, range_max=50, max_score=0.8, relative_margin=0.05, sampling_strategy="random") over
``corpus``, ``output_format="n-tuple"`` (one row per pair with all its negatives, as encoderkit's groups), MNRL.

rerank: CrossEncoder(model, num_labels=1) (a new one-logit head on the base) + CrossEncoderTrainer +
BinaryCrossEntropyLoss(pos_weight=num_negatives) on positives and mined negatives, as its training examples
(training_gooaq_bce.py): mine_hard_negatives(range_min=0, range_max=100, margin=0, sampling_strategy="top",
output_format="labeled-pair"), lr 2e-5, warmup ratio 0.1. ``batch_size`` is in labelled pairs there.

``train_s``: the whole training call: model load, mining, Trainer.train() and the save.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def main() -> int:
    job = json.loads(sys.stdin.read())
    import torch

    torch.set_num_threads(int(job.get("threads", 1)))
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives
    from transformers import set_seed

    seed = int(job["seed"])
    set_seed(seed)
    k = int(job.get("num_negatives", 0))
    pairs = job["pairs"]
    train = Dataset.from_dict({"query": [q for q, _ in pairs], "positive": [p for _, p in pairs]})
    scratch = tempfile.mkdtemp(prefix="st_trainer_")
    t0 = time.perf_counter()
    if job["kind"] == "embed":
        from sentence_transformers import SentenceTransformer, SentenceTransformerTrainer
        from sentence_transformers import SentenceTransformerTrainingArguments as Args
        from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
        from sentence_transformers.training_args import BatchSamplers

        model = SentenceTransformer(job["model"], device="cpu")
        model.max_seq_length = int(job["max_length"])
        if k:
            train = mine_hard_negatives(train, model, corpus=job["corpus"], range_min=10, range_max=50,
                                        max_score=0.8, relative_margin=0.05, num_negatives=k,
                                        sampling_strategy="random", output_format="n-tuple", batch_size=64)
        log(f"embed: {len(train)} rows, columns {train.column_names}")
        args = Args(output_dir=scratch, num_train_epochs=float(job["epochs"]),
                    per_device_train_batch_size=int(job["batch_size"]), seed=seed, data_seed=seed,
                    batch_sampler=BatchSamplers.NO_DUPLICATES, save_strategy="no", logging_steps=10,
                    report_to="none", use_cpu=True, dataloader_drop_last=False)
        trainer = SentenceTransformerTrainer(model=model, args=args, train_dataset=train,
                                             loss=MultipleNegativesRankingLoss(model))
        trainer.train()
        model.save(job["out"])
    elif job["kind"] == "rerank":
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.cross_encoder import CrossEncoder, CrossEncoderTrainer
        from sentence_transformers.cross_encoder import CrossEncoderTrainingArguments as Args
        from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss

        embedder = SentenceTransformer(job["model"], device="cpu")  # the miner: the base bi-encoder
        train = mine_hard_negatives(train, embedder, corpus=job["corpus"], num_negatives=k, margin=0, range_min=0,
                                    range_max=100, sampling_strategy="top", output_format="labeled-pair",
                                    batch_size=64)
        del embedder
        log(f"rerank: {len(train)} labelled pairs, columns {train.column_names}")
        model = CrossEncoder(job["model"], num_labels=1, max_length=int(job["max_length"]), device="cpu")
        loss = BinaryCrossEntropyLoss(model=model, pos_weight=torch.tensor(float(k)))
        args = Args(output_dir=scratch, num_train_epochs=float(job["epochs"]),
                    per_device_train_batch_size=int(job["batch_size"]), learning_rate=2e-5, warmup_ratio=0.1,
                    seed=seed, data_seed=seed, save_strategy="no", logging_steps=10, report_to="none",
                    use_cpu=True)
        trainer = CrossEncoderTrainer(model=model, args=args, train_dataset=train, loss=loss)
        trainer.train()
        model.save(job["out"])
    else:
        raise SystemExit(f"unknown kind {job['kind']!r}")
    seconds = time.perf_counter() - t0
    print(json.dumps({"train_s": seconds, "rows": len(train), "steps": int(trainer.state.global_step)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
