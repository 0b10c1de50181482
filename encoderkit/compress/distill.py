"""`encoderkit distill`: train a smaller student on a teacher's soft targets.

``mode=agnostic`` is the DistilBERT recipe (every other teacher layer, masked-LM blocks, KL + MLM + cosine);
``mode=task`` learns a fine-tuned teacher's logits, the task's ``distill_kind`` picking the recipe (classify here;
embed, rerank/NER/QA and ``to=static`` in the sibling modules). Teacher and student share the tokenizer: the KL
compares distributions over the same ids.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from encoderkit.compress.distill_embed import run_embed
from encoderkit.compress.distill_static import WEIGHTINGS, run_static
from encoderkit.compress.distill_tasks import KINDS as TASK_KINDS
from encoderkit.compress.distill_tasks import run_task
from encoderkit.compress.recovery import input_batches
from encoderkit.compress.students import (
    DistillResult,
    fit_and_save,
    is_multi_label,
    make_student,
    sigmoid_target_loss,
    soft_target_kl,
)
from encoderkit.compress.task_data import read_task_inputs
from encoderkit.config import StageConfig, arg, check
from encoderkit.data import prepare
from encoderkit.data.masking import Masker, MaskingSpec
from encoderkit.errors import EncoderkitError
from encoderkit.models.card import inherited_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.mlm import mlm_layout
from encoderkit.tasks import TASKS, get_task
from encoderkit.train.engine import IndexedBatches


def hidden_cosine_loss(student_hidden: torch.Tensor, teacher_hidden: torch.Tensor,
                       attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of 1 - cos(student, teacher) over real tokens: (B, L, H) each, the student already projected to
    the teacher's width; ``attention_mask`` (B, L) is 0 on padding. Zero when the directions agree."""
    cos = F.cosine_similarity(student_hidden.float(), teacher_hidden.float(), dim=-1)  # (B, L)
    if attention_mask is None:
        return (1.0 - cos).mean()
    m = attention_mask.bool()
    return (1.0 - cos[m]).mean() if m.any() else cos.sum() * 0.0


@dataclass(frozen=True)
class LossWeights:
    kl: float = 1.0
    hard: float = 0.5
    cos: float = 0.5
    temperature: float = 2.0


class DistillLoss(nn.Module):
    """The weighted distillation loss; holds the projection for a narrower student.

    ``forward(student_out, teacher_out, batch)`` returns the loss and its parts (floats). ``labels`` are (B, L)
    with -100 outside masked positions for MLM, or (B,) class ids. With ``multi_label`` (a sigmoid per label)
    the ``kl`` part is :func:`sigmoid_target_loss` and there is no hard part.
    """

    def __init__(self, weights: LossWeights, student_width: int, teacher_width: int, mlm: bool,
                 multi_label: bool = False) -> None:
        super().__init__()
        self.w = weights
        self.mlm = mlm
        self.multi_label = multi_label
        narrower = student_width != teacher_width and weights.cos > 0
        self.proj = nn.Linear(student_width, teacher_width) if narrower else None

    def forward(self, student_out: Any, teacher_out: Any,
                batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        s_logits, t_logits = student_out.logits, teacher_out.logits
        labels = batch.get("labels")
        parts: dict[str, torch.Tensor] = {}
        if self.mlm:
            picked = labels != -100 if labels is not None else batch["attention_mask"].bool()  # (B, L)
            parts["kl"] = soft_target_kl(s_logits[picked], t_logits[picked], self.w.temperature)
            if self.w.hard and labels is not None:
                parts["hard"] = (F.cross_entropy(s_logits[picked].float(), labels[picked]) if picked.any()
                                 else s_logits.sum() * 0)
        else:
            flat_s, flat_t = s_logits.reshape(-1, s_logits.shape[-1]), t_logits.reshape(-1, t_logits.shape[-1])
            if self.multi_label:
                parts["kl"] = sigmoid_target_loss(flat_s, flat_t, self.w.temperature)
            elif s_logits.shape[-1] > 1:
                parts["kl"] = soft_target_kl(flat_s, flat_t, self.w.temperature)
            else:
                parts["kl"] = F.mse_loss(flat_s.float(), flat_t.float())
            if self.w.hard and labels is not None and not self.multi_label:
                parts["hard"] = (F.cross_entropy(flat_s.float(), labels.reshape(-1), ignore_index=-100)
                                 if s_logits.shape[-1] > 1 else F.mse_loss(flat_s.float().squeeze(-1), labels.float()))
        if self.w.cos:
            s_h = student_out.hidden_states[-1]
            if self.proj is not None:
                s_h = self.proj(s_h)
            parts["cos"] = hidden_cosine_loss(s_h, teacher_out.hidden_states[-1], batch.get("attention_mask"))
        weight = {"kl": self.w.kl, "hard": self.w.hard, "cos": self.w.cos}
        loss = sum(weight[k] * v for k, v in parts.items())
        return loss, {k: float(v.detach()) for k, v in parts.items()}


class DistillModule(nn.Module):
    """The trainable part: the student and the loss (with its projection). ``forward(batch, teacher_out)``
    returns ``(loss, parts)``; the teacher stays outside, neither trained nor checkpointed."""

    def __init__(self, student: nn.Module, loss: DistillLoss) -> None:
        super().__init__()
        self.student = student
        self.loss = loss

    def forward(self, batch: dict[str, torch.Tensor], teacher_out: Any) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        out = self.student(**inputs, output_hidden_states=self.loss.w.cos > 0)
        return self.loss(out, teacher_out, batch)


LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


def make_loss_fn(teacher: nn.Module, want_hidden: bool) -> LossFn:
    """``loss_fn(module, batch)`` for :func:`encoderkit.train.engine.fit`: teacher outputs under
    ``no_grad`` (teacher in eval mode: no dropout), then the student and the loss."""

    def loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            t_out = teacher(**inputs, output_hidden_states=want_hidden)
        return module(batch, t_out)

    return loss_fn


# -- data ------------------------------------------------------------------------------------------

def task_batches(path: str, tokenizer: Any, teacher_config: Any, batch_size: int, seq_len: int, seed: int,
                 limit: int = 0, folder: str | Path | None = None, task: str = "classify") -> tuple[Any, int, bool]:
    """A length-bucketed engine batch source over a ``task`` file, read with the columns of the teacher
    ``folder``'s card (labels when the file has them); returns the source, the number of examples and whether
    gold labels were found."""
    label2id: dict[str, int] | None = {str(k): int(v)
                                       for k, v in (getattr(teacher_config, "label2id", None) or {}).items()}
    if is_multi_label(teacher_config):  # label sets, not class ids: no hard loss
        label2id = None
    inputs = read_task_inputs(path, task, folder=folder, label2id=label2id, limit=limit)
    return input_batches(tokenizer, inputs, seq_len, batch_size, seed), len(inputs), inputs.labels is not None


def agnostic_batches(data: str, tokenizer: Any, batch_size: int, mask_rate: float, seed: int,
                     limit: int = 0) -> tuple[Any, int]:
    """An engine batch source of dynamically masked MLM blocks from a prepared data folder."""
    blocks = load_blocks(data)  # (N, L) token ids
    if limit:
        blocks = blocks[:limit]
    check(len(blocks) >= batch_size, f"{data}: {len(blocks)} blocks, fewer than one batch of {batch_size}")
    masker = Masker.from_tokenizer(tokenizer, MaskingSpec(rate=mask_rate), seed)

    def make_batch(idx: Any, epoch: int) -> dict[str, torch.Tensor]:
        return masker(blocks[idx], idx, epoch)

    return IndexedBatches(len(blocks), batch_size, make_batch, seed=seed), len(blocks)


def load_blocks(data: str | Path) -> Any:
    """The (N, L) token-id blocks of a folder written by `encoderkit data prepare`."""
    return prepare.open_blocks(data, "train")


# -- the stage ---------------------------------------------------------------------------------------

DEFAULT_LR = 1e-4  # unless the teacher's task says otherwise (Task.distill_lr: 3e-4 for a reranker)


@dataclass
class DistillConfig(StageConfig):
    """Settings of `encoderkit distill` (and of a recipe step ``lever: distill``)."""

    teacher: str = arg(help="Teacher model folder (a fine-tuned task model for mode=task, an MLM model for "
                            "mode=agnostic).", required=True)
    out: str = arg(help="Output folder for the student.", required=True)
    mode: str = arg("task", choices=("task", "agnostic"), help="task: learn the teacher's task logits on task data; "
                    "agnostic: DistilBERT-style MLM distillation on prepared blocks.")
    student: str | None = arg(None, help="An existing student folder (same tokenizer as the teacher); default: built "
                              "from the teacher.")
    layers: str = arg("every-other", help="Teacher layers the student keeps and is initialised from: 'every-other' "
                      "(0,2,4,...) or a list like '0,2,5'. A cut rerank teacher scores no better than chance until "
                      "trained back; every other layer learns fastest.")
    hidden_size: int | None = arg(None, help="Build a narrower student of this width (random init, hidden states "
                                  "matched through a learned projection).")
    train: str | None = arg(None, help="mode=task: the teacher's task data, read by the task's reader (classify: a "
                            "table with the text/pair columns of the teacher's card; its label column adds the hard "
                            "loss; ner: CoNLL/JSONL; qa: SQuAD JSON; rerank: see --miner). An embed teacher: any "
                            "corpus (text files, JSONL, folders, a BEIR source: its corpus, plus the queries of a "
                            "split named like scifact.zip#train; comma-separated).")
    data: str | None = arg(None, help="mode=agnostic: a folder written by `encoderkit data prepare` (packed token "
                           "blocks).")
    follow_links: bool = arg(False, help="An embed teacher's --train corpus (and --to static's): also read files that "
                             "symbolic links inside a corpus folder point to outside it (by default such links are "
                             "skipped and counted).")
    kl_weight: float = arg(1.0, help="Weight of T^2 * KL(teacher || student) on soft targets.")
    hard_weight: float = arg(0.5, help="Weight of the hard loss: MLM cross-entropy (agnostic) or cross-entropy on "
                             "gold labels (task).")
    cos_weight: float = arg(0.5, help="Weight of 1 - cosine between the last hidden states (0 turns it off).")
    temperature: float = arg(2.0, help="Softmax temperature of the soft targets.")
    mask_rate: float = arg(0.15, help="mode=agnostic: fraction of tokens masked.")
    epochs: float = arg(3.0, help="Passes over the training data (unless max_steps is set).")
    max_steps: int = arg(0, help="Optimizer steps (0: use epochs).")
    lr: float = arg(0.0, help="Peak learning rate of the student (0: 3e-4 for a rerank teacher, whose cut student "
                    "ranks at chance until trained back and learns far faster at 3e-4 than at 1e-4; else 1e-4).")
    warmup: float = arg(0.06, help="Warmup: a fraction of the steps (< 1) or a number of steps.")
    batch_size: int = arg(32, help="Examples per optimizer step.")
    seq_len: int = arg(0, help="mode=task: longest input in tokens, longer ones truncated (0: the teacher's max "
                       "length, the length it serves at: e.g. 256 for a QA or rerank model, 128 for a classifier).")
    limit: int = arg(0, help="Use only the first N training examples (0: all).")
    seed: int = arg(0, help="Seed of shuffling, masking and dropout.")
    matryoshka_dims: list[int] = arg([], help="embed teacher: also match these leading embedding sizes (Matryoshka), "
                                     "e.g. 128,256.")
    miner: str | None = arg(None, help="rerank teacher with a BEIR --train: the bi-encoder folder whose top "
                            "--candidates per query the teacher scores.")
    candidates: int = arg(16, help="rerank teacher: candidate passages per query (each list is cut to the shortest, "
                          "at most this).")
    candidate_depth: int = arg(0, help="rerank teacher with a BEIR --train and --miner: draw each query's --candidates "
                               "from the miner's top N: the top half of them, and a seeded sample of ranks below down "
                               "to N (the list a reranker serves, e.g. 100: the student also learns to push down the "
                               "50th and 90th documents). 0: the top --candidates.")
    pseudo_queries: int = arg(0, help="rerank teacher with a BEIR --train and --miner: also N corpus documents "
                              "(seeded sample) as queries, each its title (else its first sentence), with the miner's "
                              "top --candidates scored by the teacher: label-free lists beyond the split's queries "
                              "(SciFact's train split has 809).")
    fresh_pseudo_queries: bool = arg(False, help="with --pseudo-queries N: a new N titles every epoch (N x epochs "
                                     "corpus documents, no two epochs sharing one; the teacher scores each set once) "
                                     "instead of the same N each epoch: past 3 epochs a cut cross-encoder learns from "
                                     "new lists, not repeats.")
    loss: str = arg("kl", choices=("kl", "mse"), help="rerank teacher: KL over each query's candidate list (softmax "
                    "of the scores) or MSE on the scores.")
    to: str = arg("", choices=("", "static"), help="static: distil an embed teacher into a static embedding model "
                  "(a vector per token of the --train corpus, PCA to --dims, frequency-weighted; a text is the mean of "
                  "its tokens): texts/s of a table lookup, loads in sentence-transformers, model2vec and every "
                  "encoderkit stage that embeds. Empty: a transformer student.")
    dims: int = arg(0, help="--to static: dimensions of the token vectors (PCA of the teacher's; at most its width). "
                    "0: 256, or the teacher's width if it is narrower.")
    fit_texts: int = arg(20000, help="--to static: then fit the token vectors to the teacher's embeddings of N corpus "
                         "pieces (1, 2 or 4 sentences, a seeded sample): loss 1 - cosine, --epochs passes at --lr "
                         "(0: 1e-2), --batch-size texts a step; the teacher's pass over the pieces is most of the "
                         "time. 0: no fit.")
    weighting: str = arg("sif", choices=WEIGHTINGS, help="--to static: token weights from the corpus counts: sif "
                         "(a / (a + p(token)), a = 1e-3), zipf (log(1 + frequency rank), model2vec's) or none.")
    overwrite: bool = arg(False, help="Replace an existing --out folder.")
    resume: bool = arg(False, speed=True, help="Continue an interrupted run from its latest checkpoint (kept in "
                       ".<out>.run beside --out) with the same settings: the same lists in the same order, no replay.")
    save_every: int = arg(100, speed=True, help="Checkpoint every N steps, so --resume loses at most N steps (0: only "
                          "at the end).")
    bf16: bool | None = arg(None, speed=True, help="bf16 autocast (default: on where the hardware has native bf16).")

    # what `distill --to static` reads (compress/distill_static.py); `distill --to static --help` lists only these
    FLAG_VIEWS: ClassVar[dict[str, dict[str, tuple[str, ...]]]] = {"to": {"static": (
        "teacher", "out", "to", "train", "follow_links", "dims", "fit_texts", "weighting", "epochs", "batch_size", "lr",
        "seed", "overwrite")}}

    def validate(self) -> None:
        check(self.temperature > 0, f"temperature must be > 0, got {self.temperature}")
        check(self.lr >= 0, f"lr must be >= 0 (0: the task's default), got {self.lr}")
        check(self.candidate_depth >= 0, f"candidate_depth must be >= 0, got {self.candidate_depth}")
        check(self.pseudo_queries >= 0, f"pseudo_queries must be >= 0, got {self.pseudo_queries}")
        check(self.pseudo_queries > 0 or not self.fresh_pseudo_queries,
              "fresh_pseudo_queries draws a new --pseudo-queries N titles each epoch: set pseudo_queries > 0 too")
        check(self.seq_len >= 0, f"seq_len must be >= 0 (0: the teacher's max length), got {self.seq_len}")
        check(min(self.kl_weight, self.hard_weight, self.cos_weight) >= 0, "loss weights must be >= 0")
        check(self.kl_weight + self.hard_weight + self.cos_weight > 0, "at least one loss weight must be > 0")
        if self.mode == "task":
            check(bool(self.train), "distill --to static needs --train: the corpus (passages) to take the vocabulary "
                  "from" if self.to else "distill mode=task needs --train (the task's texts)")
        else:
            check(bool(self.data), "distill mode=agnostic needs --data (a folder from `encoderkit data prepare`)")
        check(self.hidden_size is None or self.student is None, "give either --student or --hidden-size, not both")
        if self.to == "static":
            check(self.mode == "task", "distill --to static reads a corpus (--train), not prepared MLM blocks: "
                  "drop --mode agnostic")
            check(self.dims >= 0, f"--dims must be at least 1 (0: 256 or the teacher's width), got {self.dims}")
            check(self.fit_texts >= 0, f"--fit-texts must be >= 0 (0: no fit), got {self.fit_texts}")


def require_masked_lm(teacher: nn.Module, folder: str) -> None:
    """Refuse, naming the family, an agnostic-distillation teacher without a masked-LM head (an ELECTRA
    discriminator, a bare encoder): MLM distillation matches the teacher's word predictions."""
    try:
        mlm_layout(teacher)
    except EncoderkitError:
        family = getattr(teacher.config, "model_type", type(teacher).__name__)
        raise EncoderkitError(f"distill --mode agnostic: {family} teachers without a masked-LM head are not supported "
                              f"({folder} holds a {type(teacher).__name__}); MLM distillation matches the teacher's "
                              f"word predictions: continue pretraining it first (encoderkit pretrain --model {folder} "
                              "adds a masked-LM head) and distil that folder") from None


def run(config: DistillConfig) -> DistillResult:
    """Distil a teacher into a smaller student (task-specific or task-agnostic, DistilBERT-style). In task mode
    ``seq_len`` 0 is the teacher's max length and ``lr`` 0 the task's ``distill_lr`` (else 1e-4)."""
    if config.to == "static":
        return run_static(config)
    task, cfg = None, config  # agnostic, or a teacher of no fine-tuned task: the logits distillation below
    if config.mode == "task":
        card = ModelFolder.open(config.teacher, tokenizer=False)
        task = get_task(card.task) if card.task in TASKS else None
        cfg = config if config.seq_len else dataclasses.replace(config, seq_len=card.max_length)
    if not cfg.lr:
        cfg = dataclasses.replace(cfg, lr=(task.distill_lr if task else None) or DEFAULT_LR)
    kind = task.distill_kind if task else "logits"
    if kind == "embedding":
        return run_embed(cfg)
    if kind in TASK_KINDS:
        return run_task(cfg, task)

    teacher_folder = ModelFolder.open(cfg.teacher)
    teacher = teacher_folder.load(frozen=True)
    if cfg.mode == "agnostic":
        require_masked_lm(teacher, cfg.teacher)
    tokenizer = teacher_folder.tokenizer()
    student, layers = make_student(cfg, teacher)
    weights = LossWeights(cfg.kl_weight, cfg.hard_weight, cfg.cos_weight, cfg.temperature)
    if cfg.mode == "agnostic":
        source, n_examples = agnostic_batches(cfg.data, tokenizer, cfg.batch_size, cfg.mask_rate, cfg.seed,
                                              cfg.limit)
    else:
        source, n_examples, has_labels = task_batches(cfg.train, tokenizer, teacher.config, cfg.batch_size,
                                                      cfg.seq_len, cfg.seed, cfg.limit, folder=cfg.teacher,
                                                      **({"task": task.name} if task else {}))
        if not has_labels:
            weights = LossWeights(weights.kl, 0.0, weights.cos, weights.temperature)
    loss = DistillLoss(weights, student.config.hidden_size, teacher.config.hidden_size,
                       mlm=cfg.mode == "agnostic", multi_label=is_multi_label(teacher))
    module = DistillModule(student, loss)

    def save(folder: Path) -> None:
        student.save_pretrained(folder)
        tokenizer.save_pretrained(folder)

    res = fit_and_save(cfg, module, make_loss_fn(teacher, weights.cos > 0), source, save, examples=n_examples,
                       layers=layers, facts=inherited_card(teacher_folder.card))
    return DistillResult(Path(cfg.out), layers, sum(p.numel() for p in teacher.parameters()),
                         sum(p.numel() for p in student.parameters()), res.steps, res.train_logs)
