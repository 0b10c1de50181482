"""Recovery training after pruning (and QAT): the compressed model learns the uncompressed one's outputs on
the task's inputs, whatever the head (:func:`output_kd`: KL for QA positions, NER tags and classes, MSE for a
single score, the pooled unit vectors for an embedding). :func:`self_target_loss` is the label-free loss Taylor
importance scores differentiate.
"""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from encoderkit.compress.distill_tasks import NEG, masked_token_kl, position_kl
from encoderkit.compress.students import is_multi_label, sigmoid_target_loss, soft_target_kl
from encoderkit.compress.task_data import TaskInputs
from encoderkit.config import check
from encoderkit.models.pooling import SENTENCE, default_pooling, pool
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.classify.features import featurize
from encoderkit.train import engine


def _pooled(out: Any, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    return F.normalize(pool(out.last_hidden_state.float(), mask, pooling), dim=-1)


def output_kd(s_out: Any, t_out: Any, mask: torch.Tensor, temperature: float, pooling: str = default_pooling(SENTENCE),
              multi_label: bool = False) -> torch.Tensor:
    """The distance of student outputs ``s_out`` to teacher outputs ``t_out``, by what the model returns: ``T^2 *
    KL`` of QA start and end positions (halved), NER tags or classes; each label's sigmoid with ``multi_label``;
    squared error of a single score or of the pooled unit vectors. Zero when the outputs agree."""
    if getattr(s_out, "start_logits", None) is not None:
        return (position_kl(s_out.start_logits, t_out.start_logits, mask, temperature)
                + position_kl(s_out.end_logits, t_out.end_logits, mask, temperature)) / 2
    logits = getattr(s_out, "logits", None)
    if logits is None:
        return ((_pooled(s_out, mask, pooling) - _pooled(t_out, mask, pooling)) ** 2).sum(-1).mean()
    if logits.dim() == 3:
        return masked_token_kl(logits, t_out.logits, mask, temperature)
    if multi_label:
        return sigmoid_target_loss(logits, t_out.logits, temperature)
    if logits.shape[-1] == 1:
        return F.mse_loss(logits.float(), t_out.logits.float())
    return soft_target_kl(logits, t_out.logits, temperature)


def self_target_loss(out: Any, mask: torch.Tensor, multi_label: bool = False) -> torch.Tensor:
    """A label-free loss of a model's outputs against their own detached values, with a non-zero gradient (for
    Taylor importance): cross-entropy to the argmax for classes, tags and QA positions (binary, to each label's own
    decision, with ``multi_label``); else the squared score or last hidden state."""
    if getattr(out, "start_logits", None) is not None:
        pad = ~mask.bool()
        parts = [F.cross_entropy(x.float().masked_fill(pad, NEG), x.detach().masked_fill(pad, NEG).argmax(-1))
                 for x in (out.start_logits, out.end_logits)]
        return sum(parts) / 2
    logits = getattr(out, "logits", None)
    if logits is None:
        return out.last_hidden_state.float().pow(2).mean()
    if logits.dim() == 3:
        m = mask.bool()
        flat = logits[m]
        return F.cross_entropy(flat.float(), flat.detach().argmax(-1))
    if multi_label:
        decided = (torch.sigmoid(logits.detach().float()) >= 0.5).float()
        return F.binary_cross_entropy_with_logits(logits.float(), decided)
    if logits.shape[-1] == 1:
        return logits.float().pow(2).mean()
    return F.cross_entropy(logits.float(), logits.detach().argmax(-1))


def input_batches(tokenizer: Any, inputs: TaskInputs, seq_len: int, batch_size: int, seed: int,
                  with_labels: bool = True) -> Any:
    """A length-bucketed engine batch source over ``inputs`` (``labels`` (B,) when labelled)."""
    singles = not isinstance(inputs.texts[0], (tuple, list))
    texts = list(inputs.texts) if singles else [a for a, _ in inputs.texts]
    rows = featurize(tokenizer, texts, None if singles else [b for _, b in inputs.texts], seq_len)
    if with_labels and inputs.labels is not None:
        for r, y in zip(rows, inputs.labels, strict=True):
            r["labels"] = np.int64(y)
    check(len(rows) >= batch_size, f"{inputs.source}: {len(rows)} examples, fewer than one batch of {batch_size}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), batch_size,
                           lambda idx, epoch: encode_batch([rows[int(i)] for i in idx], pad), seed=seed)


def recover(model: torch.nn.Module, teacher: torch.nn.Module, tokenizer: Any, inputs: TaskInputs, cfg: Any,
            masks: dict[str, torch.Tensor], steps: int, linears: list[tuple[str, torch.nn.Linear]],
            pooling: str = default_pooling(SENTENCE)) -> dict[str, Any]:
    """Fine-tune ``model`` for ``steps`` on ``inputs``: ``kd_alpha`` * the output distance to ``teacher`` +
    (1 - ``kd_alpha``) * cross-entropy on gold labels (labelled classify data; KD only otherwise). The gradients of
    the ``linears`` named in ``masks`` are masked, so pruned weights stay zero."""
    seq_len = getattr(cfg, "seq_len", None) or getattr(cfg, "calib_seq_len", 128)
    multi = is_multi_label(teacher)
    labelled = inputs.labels is not None and not multi  # only single-label classify data carries class ids
    source = input_batches(tokenizer, inputs, seq_len, cfg.batch_size, cfg.seed, with_labels=labelled)
    hooks = [lin.weight.register_hook(lambda g, m=masks[n]: g * m) for n, lin in linears if n in masks]
    alpha = getattr(cfg, "kd_alpha", 0.5) if labelled else 1.0
    temperature = getattr(cfg, "temperature", 2.0)
    teacher.eval()

    def loss_fn(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        labels = batch.get("labels")
        inputs_ = {k: v for k, v in batch.items() if k != "labels"}
        out = module(**inputs_)
        with torch.no_grad():
            t_out = teacher(**inputs_)
        kd = output_kd(out, t_out, inputs_["attention_mask"], temperature, pooling, multi_label=multi)
        loss = alpha * kd
        if labels is not None and alpha < 1:
            loss = loss + (1 - alpha) * F.cross_entropy(out.logits.float(), labels.reshape(-1))
        return loss, {"kd": float(kd.detach())}

    settings = engine.TrainSettings(lr=cfg.lr, max_steps=steps, batch_size=cfg.batch_size, warmup=0.1, seed=cfg.seed)
    try:
        with tempfile.TemporaryDirectory(prefix="encoderkit-recovery-") as run_dir:
            result = engine.fit(model, loss_fn, source, settings, run_dir)
    finally:
        for h in hooks:
            h.remove()
    model.eval()
    return {"steps": result.steps, "examples": len(inputs), "kd_alpha": alpha, "last": result.train_logs,
            "seconds": round(result.seconds, 1)}
