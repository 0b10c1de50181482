"""Embedding distillation: a smaller student reproduces the teacher's sentence embeddings, from text alone (the
sentence-transformers "model distillation" recipe). The loss is ``||s - t||^2`` of the unit vectors, plus the same
on the re-normalised leading ``matryoshka_dims``; the texts are corpus pieces of 1, 2 and 4 sentences, so the
student sees query- and passage-length inputs. The student keeps the teacher's sentence-transformers module files,
so it embeds like the teacher.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from encoderkit.compress.students import (
    DistillResult,
    build_student_from_teacher,
    check_same_task,
    check_same_tokenizer,
    fit_and_save,
    parse_layer_map,
)
from encoderkit.config import check
from encoderkit.data.readers import ReadStats
from encoderkit.errors import EncoderkitError
from encoderkit.models.card import inherited_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files
from encoderkit.models.pooling import task_pooling
from encoderkit.tasks.batching import BucketedBatches, encode_batch
from encoderkit.tasks.embed.embedder import tokenize
from encoderkit.tasks.embed.features import BiEncoder, encode, folder_max_length, save_sentence_transformers
from encoderkit.tasks.embed.texts import training_texts
from encoderkit.train.engine import native_bf16

_PLAIN_MODULES = ("Transformer", "Pooling", "Normalize")


# -- the teacher's folder ----------------------------------------------------------------------------

def check_plain_embedder(folder: Path) -> None:
    """Raise unless ``folder``'s sentence-transformers modules are Transformer -> Pooling [-> Normalize]
    (a Dense or other module would be part of the teacher's embedding but not of the student's)."""
    modules = folder / "modules.json"
    if not modules.is_file():
        return
    for m in json.loads(modules.read_text(encoding="utf-8")):
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _PLAIN_MODULES:
            raise EncoderkitError(f"{modules}: module {m.get('path')!r} is a {kind}; embedding distillation handles "
                                  f"{' -> '.join(_PLAIN_MODULES)} teachers only")


# -- loss and training -------------------------------------------------------------------------------

def embedding_mse(student: torch.Tensor, teacher: torch.Tensor,
                  dims: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
    """``||s - t||^2`` of the unit vectors (mean over rows) for the full size and each Matryoshka size, of the
    (B, H) raw pooled student vectors and the teacher's unit embeddings. Zero when the directions agree."""
    parts: dict[str, torch.Tensor] = {}
    for d in [student.shape[1]] + [d for d in dims if d < student.shape[1]]:
        s = nn.functional.normalize(student[:, :d].float(), dim=-1)
        t = nn.functional.normalize(teacher[:, :d].float(), dim=-1)
        parts[f"mse_{d}"] = ((s - t) ** 2).sum(-1).mean()
    loss = sum(parts.values())
    return loss, {k: float(v.detach()) for k, v in parts.items()}


@torch.no_grad()
def teacher_embeddings(teacher: Any, tokenizer: Any, texts: list[str], max_length: int, batch_size: int = 64,
                       bf16: bool = False) -> np.ndarray:
    """The teacher's unit embeddings (N, H) float32, computed once (eval mode); ``bf16``: under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        return encode(teacher, tokenizer, texts, max_length, batch_size, progress=True)


def embed_batches(tokenizer: Any, texts: list[str], targets: np.ndarray, seq_len: int, batch_size: int,
                  seed: int) -> Any:
    """A length-bucketed engine batch source: token ids of each text and its teacher embedding."""
    rows = tokenize(tokenizer, texts, seq_len)
    for r, t in zip(rows, targets):
        r["target"] = t
    check(len(rows) >= batch_size, f"--train: {len(rows)} texts, fewer than one batch of {batch_size}")

    def make_batch(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        return encode_batch([rows[i] for i in idx], tokenizer.pad_token_id or 0)

    return BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), batch_size, make_batch, seed=seed)


def run_embed(cfg: Any) -> Any:
    """Distil an embed teacher (see the module docstring); ``cfg`` is a DistillConfig."""
    teacher_dir = Path(cfg.teacher)
    check(bool(cfg.train), "distilling an embed model needs --train: a corpus of plain text (no labels)")
    check(cfg.hidden_size is None, "--hidden-size is not supported for embed distillation; use --layers or --student")
    check_plain_embedder(teacher_dir)
    teacher_folder = ModelFolder.open(teacher_dir, tokenizer=False)
    card = inherited_card(teacher_folder.card)
    pooling = task_pooling(teacher_folder, "embed")  # the teacher's own, from its card or ST files
    max_length = card.get("max_length") or folder_max_length(teacher_dir) or 256
    tokenizer = teacher_folder.tokenizer()
    teacher_enc = teacher_folder.load(task="embed")  # a quantized or head-pruned teacher is rebuilt
    teacher = BiEncoder(teacher_enc, pooling)
    layers: list[int] | None = None
    if cfg.student:
        check_same_tokenizer(teacher_dir, cfg.student)
        check_same_task(teacher_dir, cfg.student)
        student_enc = ModelFolder.open(cfg.student, tokenizer=False).load(task="embed")
        check(student_enc.config.hidden_size == teacher_enc.config.hidden_size,
              f"student {cfg.student} has hidden size {student_enc.config.hidden_size}, the teacher "
              f"{teacher_enc.config.hidden_size}; embedding distillation needs the same embedding size")
    else:
        layers = parse_layer_map(cfg.layers, teacher_enc.config.num_hidden_layers)
        student_enc = build_student_from_teacher(teacher_enc, layers)
    dims = sorted({int(d) for d in cfg.matryoshka_dims})
    bad = [d for d in dims if not 0 < d <= teacher_enc.config.hidden_size]
    check(not bad, f"--matryoshka-dims {bad}: sizes must be in 1..{teacher_enc.config.hidden_size}")

    read = ReadStats()
    texts = training_texts(cfg.train, cfg.limit, seed=cfg.seed, follow_links=cfg.follow_links, stats=read)
    seq_len = min(cfg.seq_len, max_length)
    bf16 = native_bf16(torch.device("cpu")) if cfg.bf16 is None else bool(cfg.bf16)
    targets = teacher_embeddings(teacher, tokenizer, texts, seq_len, bf16=bf16)
    teacher_params = sum(p.numel() for p in teacher_enc.parameters())
    del teacher, teacher_enc
    source = embed_batches(tokenizer, texts, targets, seq_len, cfg.batch_size, cfg.seed)
    module = BiEncoder(student_enc, pooling, normalize=False)  # raw pooled vectors: the loss normalises each slice

    def loss_fn(m: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = {k: v for k, v in batch.items() if k != "target"}
        return embedding_mse(m(**inputs), batch["target"], dims)

    def save(folder: Path) -> None:
        if (teacher_dir / "modules.json").is_file():
            student_enc.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
            copy_side_files(teacher_dir, folder, sentence_transformers_only=True)
        else:
            save_sentence_transformers(BiEncoder(student_enc, pooling), tokenizer, folder, max_length)

    facts = {"task": "embed", "pooling": pooling, "normalize": True, "max_length": max_length,
             "similarity": "cosine", **card, "matryoshka_dims": dims or card.get("matryoshka_dims", [])}
    res = fit_and_save(cfg, module, loss_fn, source, save, examples=len(texts), layers=layers, facts=facts)
    return DistillResult(Path(cfg.out), layers, teacher_params, sum(p.numel() for p in student_enc.parameters()),
                         res.steps, res.train_logs, skipped_links=read.skipped_links)
