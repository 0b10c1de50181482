"""Fine-tuning speed: `encoderkit finetune` vs Hugging Face Trainer, same model, data, steps, batch size.

Both train MiniLM (all-MiniLM-L6-v2) + AutoModelForSequenceClassification on SST-2 for the same
number of optimizer steps, batch size, learning rate, warmup and weight decay, in this one process,
one after the other, with the same thread count. Measured: training examples per second of the
training loop and the writing of the trained model (model loading and evaluation excluded), and dev
accuracy of each result.

The reference runs with Trainer's best settings for this CPU (``--ref-settings best``, the default):
``bf16=True`` where the CPU has native bf16 (AVX512-BF16 / AMX) and
``train_sampling_strategy="group_by_length"`` (batches of similar lengths, less padding);
``--ref-settings default`` runs Trainer as it comes (fp32, random batches). MFU: 6 x the
non-embedding parameters x the real (unpadded) tokens per second, over doctor's measured bf16 matmul
peak (fp32 peak where bf16 is not native).

    python bench/finetune_speed.py                 # short default: 100 steps each, batch 32
    python bench/finetune_speed.py --steps 2000    # about one epoch
Last line: RESULT ratio=... ex_s_ours=... ex_s_ref=... acc_ours=... acc_ref=...
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "glue_sst2"


def read_tsv(path: Path) -> tuple[list[str], list[int]]:
    texts, labels = [], []
    with open(path, encoding="utf-8") as f:
        next(f)
        for line in f:
            t, y = line.rstrip("\n").split("\t")
            texts.append(t)
            labels.append(int(y))
    return texts, labels


def ours(args, model_dir: Path, out: Path) -> tuple[float, float]:
    from encoderkit.evaluate.run import EvaluateConfig
    from encoderkit.evaluate.run import run as evaluate
    from encoderkit.train.finetune import FinetuneConfig, run

    cfg = FinetuneConfig(task="classify", model=str(model_dir), train=str(args.train), dev="", out=str(out),
                         max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                         weight_decay=0.01, max_length=128, seed=args.seed, pooling="first")  # HF's head: [CLS]
    res = run(cfg)
    acc = evaluate(EvaluateConfig(model=str(out), data=str(args.dev), batch_size=128)).metrics["accuracy"]
    return res.steps * args.batch_size / res.seconds, acc


def reference(args, model_dir: Path, out: Path) -> tuple[float, float]:
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainingArguments,
    )

    from encoderkit.hardware import native_bf16

    tok = AutoTokenizer.from_pretrained(model_dir)
    texts, labels = read_tsv(args.train)
    dtexts, dlabels = read_tsv(args.dev)

    def dataset(t: list[str], y: list[int]) -> Dataset:
        enc = tok(t, truncation=True, max_length=128)
        return Dataset.from_dict({**enc, "labels": y})

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    targs = TrainingArguments(
        output_dir=str(out), max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=128, learning_rate=args.lr, warmup_steps=args.warmup, weight_decay=0.01,
        lr_scheduler_type="linear", max_grad_norm=1.0, logging_steps=max(1, args.steps // 5), save_strategy="no",
        report_to="none", use_cpu=True, seed=args.seed, disable_tqdm=False,
        **({"bf16": native_bf16(torch.device("cpu")), "train_sampling_strategy": "group_by_length"}
           if args.ref_settings == "best" else {}),
    )
    trainer = Trainer(model=model, args=targs, train_dataset=dataset(texts, labels),
                      data_collator=DataCollatorWithPadding(tok))
    t0 = time.perf_counter()
    trainer.train()
    trainer.save_model(str(out / "final"))  # ours writes its last checkpoint inside the timed loop: so does this
    seconds = time.perf_counter() - t0
    pred = trainer.predict(dataset(dtexts, dlabels))
    acc = float((np.argmax(pred.predictions, -1) == np.asarray(dlabels)).mean())
    return args.steps * args.batch_size / seconds, acc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=Path, default=DATA / "train.tsv")
    p.add_argument("--dev", type=Path, default=DATA / "dev.tsv")
    p.add_argument("--model", default="minilm")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ref-settings", choices=("best", "default"), default="best",
                   help="HF Trainer with bf16 (where native) + length-grouped batches, or as it comes (fp32, random batches)")
    args = p.parse_args()
    import torch

    from encoderkit.hardware import describe, result_field
    from encoderkit.tasks.common import resolve_model

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    model_dir = resolve_model(args.model)
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(args.seed)
        ex_ours, acc_ours = ours(args, model_dir, Path(tmp) / "ours")
        print(f"ours: {ex_ours:.1f} ex/s, dev accuracy {acc_ours:.4f}", file=sys.stderr)
        torch.manual_seed(args.seed)
        ex_ref, acc_ref = reference(args, model_dir, Path(tmp) / "ref")
        print(f"HF Trainer: {ex_ref:.1f} ex/s, dev accuracy {acc_ref:.4f}", file=sys.stderr)
    from transformers import AutoModel, AutoTokenizer

    from encoderkit.doctor import matmul_rate
    from encoderkit.hardware import native_bf16

    body = AutoModel.from_pretrained(model_dir)
    params = sum(p.numel() for n, p in body.named_parameters() if "embeddings" not in n)
    texts = read_tsv(args.train)[0]
    tokens = float(np.mean([len(x) for x in AutoTokenizer.from_pretrained(model_dir)(
        texts[:5000], truncation=True, max_length=128)["input_ids"]]))
    bf16 = native_bf16(torch.device("cpu"))
    peak = matmul_rate(torch.bfloat16, 512, 1.0) if bf16 else matmul_rate(torch.float32, 1024, 2.0)
    mfu_ours, mfu_ref = (6 * params * tokens * ex / peak for ex in (ex_ours, ex_ref))
    print(f"{params / 1e6:.1f} M non-embedding parameters, {tokens:.1f} tokens per example; "
          f"{'bf16' if bf16 else 'fp32'} peak {peak / 1e9:.0f} GFLOP/s: MFU ours {mfu_ours:.1%}, Trainer {mfu_ref:.1%}")
    print(f"RESULT ratio={ex_ours / ex_ref:.2f} ex_s_ours={ex_ours:.1f} ex_s_ref={ex_ref:.1f} "
          f"acc_ours={acc_ours:.4f} acc_ref={acc_ref:.4f} ref_settings={args.ref_settings} mfu_ours={mfu_ours:.4f} mfu_ref={mfu_ref:.4f} steps={args.steps} batch_size={args.batch_size} "
          f"threads={torch.get_num_threads()} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
