"""Distillation of rerank, NER and QA teachers; no label is used.

- ``rerank``: the student learns the teacher's scores over each query's candidate list
  (:mod:`encoderkit.tasks.rerank.candidates`), by KL of the list's softmax (order and gaps, not the offset) or
  MSE; the teacher's scores are cached pair by pair, so a second distillation skips that pass.
- ``ner``: ``T^2 * KL`` of the per-token tag logits over real tokens; ``qa``: of the start and end logits, halved.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from encoderkit.compress.students import DistillResult, fit_and_save, make_student, soft_target_kl
from encoderkit.config import check
from encoderkit.errors import EncoderkitError
from encoderkit.io import cache_dir, write_bytes_atomic
from encoderkit.models.card import inherited_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.progress import note
from encoderkit.tasks.batching import BucketedBatches, RotatingBatches, encode_batch
from encoderkit.tasks.protocol import Task
from encoderkit.tasks.rerank.candidates import candidate_groups
from encoderkit.tasks.rerank.features import pair_rows, score_rows

NEG = -1e4  # logit given to padding before a softmax over positions


# -- rerank ------------------------------------------------------------------------------------------

def rerank_setup(cfg: Any, teacher: nn.Module, tokenizer: Any) -> tuple[Any, Any, int]:
    """(batch source, loss_fn, number of lists per epoch), the teacher scoring every pair once. With
    ``fresh_pseudo_queries`` each epoch reads the split's lists and its own set of titles' lists."""
    def epochs_for(n_split: int) -> int:  # how many title sets the run reads (one per epoch begun)
        if not cfg.fresh_pseudo_queries:
            return 1
        if cfg.max_steps:
            return max(1, math.ceil(cfg.max_steps * cfg.batch_size / (n_split + cfg.pseudo_queries)))
        return max(1, math.ceil(cfg.epochs))

    split, title_sets = candidate_groups(cfg.train, cfg.miner, cfg.candidates, candidate_depth=cfg.candidate_depth,
                                         pseudo_queries=cfg.pseudo_queries, title_sets=epochs_for, seed=cfg.seed,
                                         limit=cfg.limit)
    groups = [split + (title_sets[0] if title_sets else []), *title_sets[1:]]  # scored one by one
    size = len(split[0][1]) if split else len(title_sets[0][0][1])
    rows: list[dict[str, np.ndarray]] = []
    store = PairScores(model_fingerprint(cfg.teacher), tokenizer.pad_token_id)  # reads the weights and the cache once
    for group in groups:
        queries = [q for q, c in group for _ in c]
        passages = [p for _, c in group for p in c]
        part = pair_rows(tokenizer, queries, passages, cfg.seq_len)  # tokenised once: scored here, trained on below
        for r, s in zip(part, teacher_scores(store, teacher, part, tokenizer.pad_token_id)):
            r["teacher_score"] = s
        rows += part
    n_lists = len(rows) // size
    per_set = len(title_sets[0]) if title_sets else 0
    fixed = np.arange(len(split))
    sets = [len(split) + np.arange(i * per_set, (i + 1) * per_set) for i in range(max(1, len(title_sets)))]
    check(len(fixed) + per_set >= cfg.batch_size,
          f"--train {cfg.train}: {len(fixed) + per_set} queries, fewer than one batch of {cfg.batch_size}")

    def make_batch(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        return encode_batch([rows[int(i) * size + j] for i in idx for j in range(size)], tokenizer.pad_token_id or 0)

    lengths = np.asarray([max(len(rows[i * size + j]["input_ids"]) for j in range(size)) for i in range(n_lists)])
    source = RotatingBatches(lengths, fixed, sets, cfg.batch_size, make_batch, seed=cfg.seed)

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = {k: v for k, v in batch.items() if k != "teacher_score"}
        s = module(**inputs).logits.float().view(-1, size)
        t = batch["teacher_score"].float().view(-1, size)
        loss = soft_target_kl(s, t, cfg.temperature) if cfg.loss == "kl" else F.mse_loss(s, t)
        return loss, {cfg.loss: float(loss.detach())}

    return source, loss_fn, len(fixed) + per_set


def teacher_scores(store: PairScores, teacher: nn.Module, rows: list[dict[str, np.ndarray]], pad_id: int) -> np.ndarray:
    """The teacher's score of every tokenised pair: from ``store`` where cached, the rest scored and added, so a
    later distillation of the same teacher scores only the pairs it has not seen."""
    pairs = [b"".join(k.encode() + np.ascontiguousarray(r[k], dtype=np.int64).tobytes()
                      for k in ("input_ids", "token_type_ids") if k in r) for r in rows]
    keys = [hashlib.sha256(p).digest()[:16] for p in pairs]
    scores = store.lookup(keys)
    missing = np.flatnonzero(np.isnan(scores))
    if not missing.size:
        return scores
    new = score_rows(teacher, [rows[int(i)] for i in missing], pad_id, 64, desc="teacher scores")
    scores[missing] = new
    store.add([keys[int(i)] for i in missing], new)
    return scores


class PairScores:
    """A teacher's scores cached pair by pair in ``$ENCODERKIT_CACHE/teacher-scores/``, one ``.npz`` per teacher
    (``fingerprint``: its weights, config and tokenizer) of ``keys`` ((N, 16) uint8 token-id hashes) and
    ``scores`` ((N,) float32), read without pickle and rewritten atomically. An unreadable file counts as empty;
    an unwritable one costs time later, not this run."""

    def __init__(self, fingerprint: str, pad_id: int) -> None:
        self.head = f"rerank {fingerprint} pad={pad_id}"
        self.path = cache_dir("teacher-scores") / f"{hashlib.sha256(self.head.encode()).hexdigest()[:32]}.npz"
        self.known: dict[bytes, float] = {}
        with contextlib.suppress(OSError, ValueError, KeyError), np.load(self.path, allow_pickle=False) as f:
            self.known = dict(zip((k.tobytes() for k in f["keys"]), f["scores"].tolist(), strict=True))

    def lookup(self, keys: list[bytes]) -> np.ndarray:
        """float32 scores of ``keys``, NaN where not cached."""
        return np.asarray([self.known.get(k, np.nan) for k in keys], dtype=np.float32)

    def add(self, keys: list[bytes], scores: np.ndarray) -> None:
        self.known.update(zip(keys, np.asarray(scores, dtype=np.float32).tolist(), strict=True))
        buf = io.BytesIO()
        np.savez(buf, keys=np.frombuffer(b"".join(self.known), dtype=np.uint8).reshape(-1, 16),
                 scores=np.asarray(list(self.known.values()), dtype=np.float32))
        try:
            write_bytes_atomic(self.path, buf.getvalue())
        except (EncoderkitError, OSError) as e:
            note(f"{e}; the teacher's scores are not cached, continuing without")


# -- NER and QA ----------------------------------------------------------------------------------------

def masked_token_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
                    temperature: float) -> torch.Tensor:
    """``T^2 * KL`` of per-token class distributions (B, L, C), averaged over real tokens (mask (B, L))."""
    m = mask.bool()
    return soft_target_kl(student[m], teacher[m], temperature)


def position_kl(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 * KL`` of distributions over positions (B, L) (QA start or end), padding masked out."""
    pad = ~mask.bool()
    return soft_target_kl(student.float().masked_fill(pad, NEG), teacher.float().masked_fill(pad, NEG), temperature)


def token_rows(cfg: Any, task: Task, tokenizer: Any) -> list[dict[str, np.ndarray]]:
    """Tokenised inputs, as the task reads its training data (:meth:`~encoderkit.tasks.protocol.Task.distill_rows`:
    NER sentences (words) or QA (question, context) pairs (the first window)), the first ``cfg.limit``."""
    rows = task.distill_rows(cfg, tokenizer)
    return rows[: cfg.limit] if cfg.limit else rows


def token_setup(cfg: Any, task: Task, teacher: nn.Module, tokenizer: Any) -> tuple[Any, Any, int]:
    """(batch source, loss_fn, number of examples); the teacher runs under no_grad on each batch."""
    rows = token_rows(cfg, task, tokenizer)
    check(len(rows) >= cfg.batch_size,
          f"--train {cfg.train}: {len(rows)} examples, fewer than one batch of {cfg.batch_size}")

    def make_batch(idx: np.ndarray, epoch: int) -> dict[str, torch.Tensor]:
        return encode_batch([rows[int(i)] for i in idx], tokenizer.pad_token_id or 0)

    source = BucketedBatches(np.asarray([len(r["input_ids"]) for r in rows]), cfg.batch_size, make_batch, seed=cfg.seed)

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        with torch.no_grad():
            t = teacher(**batch)
        s = module(**batch)
        mask = batch["attention_mask"]
        if task.distill_kind == "tokens":  # per-token logits; else "spans": start and end logits
            loss = masked_token_kl(s.logits, t.logits, mask, cfg.temperature)
            return loss, {"kl": float(loss.detach())}
        start = position_kl(s.start_logits, t.start_logits, mask, cfg.temperature)
        end = position_kl(s.end_logits, t.end_logits, mask, cfg.temperature)
        return (start + end) / 2, {"kl_start": float(start.detach()), "kl_end": float(end.detach())}

    return source, loss_fn, len(rows)


# -- the stage -----------------------------------------------------------------------------------------

KINDS = ("lists", "tokens", "spans")  # the task distillations here (Task.distill_kind): rerank, NER, QA
# what --train is, else the task's data_help
_TRAIN_HELP = {"lists": "a BEIR source with --miner, or JSONL {query, positive, negatives}"}


def run_task(cfg: Any, task: Task) -> Any:
    """Distil a rerank, NER or QA teacher (``cfg`` is a DistillConfig)."""
    if task.distill_kind not in KINDS:
        raise EncoderkitError(f"distill_tasks handles rerank, ner and qa teachers, not {task.name!r}")
    check(bool(cfg.train), f"distilling a {task.name} model needs --train "
                           f"({_TRAIN_HELP.get(task.distill_kind, task.data_help)})")
    teacher_folder = ModelFolder.open(cfg.teacher)
    teacher = teacher_folder.load(frozen=True)
    tokenizer = teacher_folder.tokenizer()
    student, layers = make_student(cfg, teacher)
    if task.distill_kind == "lists":
        source, loss_fn, n = rerank_setup(cfg, teacher, tokenizer)
    else:
        source, loss_fn, n = token_setup(cfg, task, teacher, tokenizer)

    def save(folder: Path) -> None:
        student.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    res = fit_and_save(cfg, student, loss_fn, source, save, examples=n, layers=layers,
                       facts={"task": task.name, **inherited_card(teacher_folder.card)})
    return DistillResult(Path(cfg.out), layers, sum(p.numel() for p in teacher.parameters()),
                         sum(p.numel() for p in student.parameters()), res.steps, res.train_logs)
