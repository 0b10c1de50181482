"""Fine-tuning speed: `encoderkit finetune` vs Hugging Face Trainer, same model, data, steps, batch size.

Both train MiniLM (all-MiniLM-L6-v2) + AutoModelForSequenceClassification on SST-2 for the same
number of optimizer steps, batch size, learning rate, warmup and weight decay, in this one process,
one after the other, with the same thread count. Measured: training examples per second of the
training loop and the writing of the trained model (model loading and evaluation excluded), and dev
accuracy of each result, judged alike: the saved folder through a plain fp32 transformers forward.

The reference runs with Trainer's best settings for this CPU (``--ref-settings best``, the default):
``bf16=True`` where the CPU has native bf16 (AVX512-BF16 / AMX) and
``train_sampling_strategy="group_by_length"`` (batches of similar lengths, less padding);
``--ref-settings default`` runs Trainer as it comes (fp32, random batches). MFU: 6 x the
non-embedding parameters x the real (unpadded) tokens per second, over doctor's measured bf16 matmul
peak (fp32 peak where bf16 is not native). The floor (the roofline of this workload on this CPU, measured
in the same run): a step's matmuls alone at the mean unpadded length plus torch's fused AdamW over the real
parameters; ``ceiling_ratio`` is what even that floor would give over the Trainer. ``int8_ratio``: ours with every
linear layer's bf16 forward+backward swapped for int8 training's (timed at the same shapes, quantisation included),
an estimate of what that lever gives (its quality is not measured).

    python bench/finetune_speed.py                 # short default: 100 steps each, batch 32
    python bench/finetune_speed.py --steps 2000    # about one epoch
Last line: RESULT ratio=... ex_s_ours=... ex_s_ref=... ceiling_ex_s=... ceiling_ratio=... acc_ours=... acc_ref=...
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


def accuracy(folder: Path, tokenizer_dir: Path, dev: Path) -> float:
    """Dev accuracy of a trained folder, the same plain fp32 transformers forward for both results (Trainer.predict
    after a bf16 + group_by_length run gave 0.52 for a model whose saved weights score 0.79: one judge for both)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    texts, labels = read_tsv(dev)
    preds: list[int] = []
    with torch.inference_mode():
        for i in range(0, len(texts), 64):
            batch = tok(texts[i:i + 64], padding=True, truncation=True, max_length=128, return_tensors="pt")
            preds += model(**batch).logits.argmax(-1).tolist()
    return float((np.asarray(preds) == np.asarray(labels)).mean())


def ours(args, model_dir: Path, out: Path) -> tuple[float, float]:
    from encoderkit.train.finetune import FinetuneConfig, run

    cfg = FinetuneConfig(task="classify", model=str(model_dir), train=str(args.train), dev="", out=str(out),
                         max_steps=args.steps, batch_size=args.batch_size, lr=args.lr, warmup=args.warmup,
                         weight_decay=0.01, max_length=128, seed=args.seed, pooling="first")  # HF's head: [CLS]
    res = run(cfg)
    return res.steps * args.batch_size / res.seconds, accuracy(out, out, args.dev)


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
    return args.steps * args.batch_size / seconds, accuracy(out / "final", model_dir, args.dev)


def _median_ms(fn, reps: int = 7) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1e3


def step_floor(model_dir: Path, batch: int, tokens: float, bf16: bool) -> tuple[float, float]:
    """What one training step cannot go below on this CPU, measured: ``(matmul ms, AdamW ms)``. The matmuls are
    every GEMM of a forward and backward pass (per linear layer X W, dY W^T and X^T dY; attention's two batched
    products forward and four backward) at ``batch`` examples of the mean unpadded length, in the training dtype;
    AdamW is torch's fused step over the model's real parameters. The rest of a step (embeddings, norms, GELU,
    dropout, softmax, the loss, clipping) is left out, so the floor is below anything that trains this model."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    c = AutoConfig.from_pretrained(model_dir)
    dtype = torch.bfloat16 if bf16 else torch.float32
    length = max(1, round(tokens))
    rows, heads, hd = batch * length, c.num_attention_heads, c.hidden_size // c.num_attention_heads
    shapes = [(rows, c.hidden_size, c.hidden_size)] * 4 + [(rows, c.hidden_size, c.intermediate_size),
                                                           (rows, c.intermediate_size, c.hidden_size)]
    gemms = []
    for m, k, n in shapes:  # forward, input gradient, weight gradient
        gemms += [(torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)),
                  (torch.randn(m, n, dtype=dtype), torch.randn(n, k, dtype=dtype)),
                  (torch.randn(k, m, dtype=dtype), torch.randn(m, n, dtype=dtype))]
    qk = (torch.randn(batch * heads, length, hd, dtype=dtype), torch.randn(batch * heads, hd, length, dtype=dtype))
    pv = (torch.randn(batch * heads, length, length, dtype=dtype), torch.randn(batch * heads, length, hd, dtype=dtype))

    def layer() -> None:
        for a, b in gemms:
            torch.mm(a, b)
        for _ in range(3):
            torch.bmm(*qk)
            torch.bmm(*pv)

    matmul = _median_ms(layer) * c.num_hidden_layers
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=2)
    for q in model.parameters():
        q.grad = torch.randn_like(q) * 1e-3
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01, fused=True)
    return matmul, _median_ms(opt.step)


def int8_linears(model_dir: Path, batch: int, tokens: float) -> tuple[float, float]:
    """The lever that could still compute the same thing faster: int8 training of every linear layer (dynamic
    symmetric int8 of both operands of each of its three GEMMs, the scheme of torchao's int8 mixed-precision
    training; the quantisation compiled by inductor). Measured against bf16 autocast, both a linear layer's forward
    plus backward with its real casts and quantisation, summed over the model's linear layers at ``batch``
    examples of the mean unpadded length: ``(bf16 ms, int8 ms)`` per step. Only timed, never trained."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoConfig

    def rows(x):  # one scale per row
        s = x.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        return (x / s).round().to(torch.int8), s.float()

    def cols(x):  # one scale per column, the quantised block transposed (contiguous) for the GEMM's first operand
        s = x.abs().amax(dim=0, keepdim=True).clamp_min(1e-12) / 127
        return (x / s).round().to(torch.int8).t().contiguous(), s.float()

    q_rows, q_cols = torch.compile(rows, dynamic=True), torch.compile(cols, dynamic=True)

    class Int8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x, w)
            (xq, sx), (wq, sw) = q_rows(x), q_rows(w)
            return torch._int_mm(xq, wq.t()) * sx * sw.t()

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            (gq, sg), (wq, sw) = q_rows(g), q_cols(w)
            dx = torch._int_mm(gq, wq.t()) * sg * sw
            (gt, sgt), (xt, sxt) = q_cols(g), q_cols(x)
            return dx, torch._int_mm(gt, xt.t()) * sgt.t() * sxt

    c = AutoConfig.from_pretrained(model_dir)
    m = batch * max(1, round(tokens))
    shapes = ([(c.hidden_size, c.hidden_size)] * 4
              + [(c.hidden_size, c.intermediate_size), (c.intermediate_size, c.hidden_size)])
    bf16 = int8 = 0.0
    for k, n in shapes:
        x = torch.randn(m, k, requires_grad=True)
        w = (torch.randn(n, k) / k ** 0.5).requires_grad_()
        g = torch.randn(m, n)

        def plain(x=x, w=w, g=g) -> None:
            with torch.autocast("cpu", torch.bfloat16):
                y = F.linear(x, w)
            y.backward(g.to(y.dtype))

        def quantised(x=x, w=w, g=g) -> None:
            Int8Linear.apply(x, w).backward(g)

        for _ in range(2):  # compile and warm
            quantised()
        bf16 += _median_ms(plain)
        int8 += _median_ms(quantised)
    return bf16 * c.num_hidden_layers, int8 * c.num_hidden_layers


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
                   help="HF Trainer with bf16 (where native) + length-grouped batches, or as it comes (fp32, random "
                        "batches)")
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
    mm_ms, adam_ms = step_floor(model_dir, args.batch_size, tokens, bf16)
    ceiling = args.batch_size / ((mm_ms + adam_ms) / 1e3)
    print(f"floor of a step on this CPU: its matmuls alone {mm_ms:.1f} ms + fused AdamW {adam_ms:.1f} ms "
          f"= {mm_ms + adam_ms:.1f} ms per {args.batch_size} examples: at most {ceiling:.0f} ex/s, "
          f"{ceiling / ex_ref:.2f}x the Trainer; ours {ex_ours / ceiling:.0%} of it", file=sys.stderr)
    lin_bf16, lin_int8 = int8_linears(model_dir, args.batch_size, tokens)
    step_ms = args.batch_size / ex_ours * 1e3
    ex_int8 = args.batch_size / ((step_ms - lin_bf16 + lin_int8) / 1e3)
    print(f"int8 training of every linear layer (the lever left): their forward+backward {lin_bf16:.1f} ms in bf16, "
          f"{lin_int8:.1f} ms in int8 per step; ours with it at most {ex_int8:.0f} ex/s, {ex_int8 / ex_ref:.2f}x the "
          f"Trainer (its quality not measured)", file=sys.stderr)
    print(f"RESULT ratio={ex_ours / ex_ref:.2f} ex_s_ours={ex_ours:.1f} ex_s_ref={ex_ref:.1f} "
          f"ceiling_ex_s={ceiling:.1f} ceiling_ratio={ceiling / ex_ref:.2f} matmul_ms={mm_ms:.1f} "
          f"adamw_ms={adam_ms:.1f} "
          f"int8_linears_ms={lin_int8:.1f} bf16_linears_ms={lin_bf16:.1f} int8_ratio={ex_int8 / ex_ref:.2f} "
          f"acc_ours={acc_ours:.4f} acc_ref={acc_ref:.4f} ref_settings={args.ref_settings} mfu_ours={mfu_ours:.4f} "
          f"mfu_ref={mfu_ref:.4f} steps={args.steps} batch_size={args.batch_size} "
          f"threads={torch.get_num_threads()} {result_field()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
