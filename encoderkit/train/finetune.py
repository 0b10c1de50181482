"""``encoderkit finetune``: train a task head on labelled data and write a model folder.

The task (:mod:`encoderkit.tasks`) reads the data and builds the model, :mod:`encoderkit.train.engine` trains it,
and the best checkpoint by the dev metric is written as a standard HF folder plus ``encoderkit.json``.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from encoderkit.config import arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_output_dir, output_dir
from encoderkit.models.anatomy import config_heads_hidden
from encoderkit.models.card import write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import get_task
from encoderkit.tasks.common import DEFAULT_MODEL, TrainData, open_model, pick
from encoderkit.tasks.options import TaskDataOptions
from encoderkit.train import checkpoint, few_label, guardrails
from encoderkit.train.engine import TrainSettings, fit

DEFAULT_LR = 3e-5  # a task's fine-tuning rate unless it says otherwise (Task.finetune_lr)
NER_LR = get_task("ner").finetune_lr
SMALL_HIDDEN = 512  # a model this narrow or narrower (MiniLM's 384) takes its task's Task.small_model_lr
SMALL_LR = get_task("classify").small_model_lr
NARROW_PAIR_LR = get_task("qa").small_model_lr  # qa's and rerank's (tests/test_tasks_ner.py)


def task_lr(name: str, hidden: int = 0) -> float:
    """The default peak learning rate of ``--task name`` for a model of ``hidden`` width (0: unknown): the task's
    ``small_model_lr`` for a model of at most :data:`SMALL_HIDDEN`, else its ``finetune_lr``, else
    :data:`DEFAULT_LR`. Small encoders move less per step at a base-size rate and want a higher one."""
    task = get_task(name)
    if 0 < hidden <= SMALL_HIDDEN and task.small_model_lr:
        return task.small_model_lr
    return task.finetune_lr or DEFAULT_LR


@dataclass
class FinetuneConfig(TaskDataOptions):
    """Fine-tune a task head (see ``--task``)."""

    model: str = arg(DEFAULT_MODEL, help="Model folder (HF layout) to start from; 'minilm' = all-MiniLM-L6-v2.")
    tokenizer: str = arg("", help="Tokenizer folder (default: the model folder's own tokenizer).")
    train: str = arg(help=(
        "Training data. classify: TSV/CSV/JSONL. ner: CoNLL column file or JSONL (tokens+tags or text+entity spans). "
        "qa: SQuAD JSON or .zip. rerank/embed: JSONL of {query, positive, negatives} or a BEIR source "
        "(folder, or SciFact zip) with '#split'."), required=True)
    dev: str = arg("", help="Dev data in the same format (best checkpoint and early stopping use it).")
    out: str = arg(help="Output model folder.", required=True)
    overwrite: bool = arg(False, help="Replace an existing --out folder.")
    lr: float = arg(0.0, help=f"Peak learning rate (AdamW); 0: the task's default: on a model of hidden size "
                              f"{SMALL_HIDDEN} or less (MiniLM) classify and ner {SMALL_LR:g}, qa and rerank "
                              f"{NARROW_PAIR_LR:g}; else ner {NER_LR:g}; every other case {DEFAULT_LR:g}. The card "
                              "records the rate used.")
    epochs: float = arg(3.0, help="Passes over the training data (ignored when --max-steps is set).")
    max_steps: int = arg(0, help="Optimizer steps to train (0: use --epochs).")
    batch_size: int = arg(32, help="Examples per optimizer step (micro-batch; see --grad-accum).")
    grad_accum: int = arg(1, help="Micro-batches accumulated per optimizer step.")
    warmup: float = arg(0.1, help="Warmup: a fraction of the steps (< 1) or a number of steps.")
    weight_decay: float = arg(0.01, help="AdamW weight decay (not on biases and norms).")
    clip_norm: float = arg(1.0, help="Gradient norm clipping (0: off).")
    eval_every: int = arg(0, help="Evaluate on --dev every N steps (0: once per epoch).")
    early_stopping: int = arg(0, help="Stop after N evaluations without a better dev metric (0: never).")
    metric: str = arg("", help="Dev metric that picks the best checkpoint (default: the task's primary one).")
    freeze: list[str] = arg([], help="Parameter name prefixes to freeze (e.g. bert.embeddings); default: nothing "
                                     "frozen.")
    max_train_examples: int = arg(0, help="Use a seeded random subset of this many training examples (0: all).")
    audit_sheet: str = arg("", help="`encoderkit label` output, reviewed: classify: the audit sheet whose gold labels "
                                    "replace the labeller's; embed/rerank on a pairs file: its sheet, whose pairs "
                                    "marked no are dropped (counted in the summary's 'audit').")
    drop_suspected: bool = arg(False, help="classify on `encoderkit label` output: drop the lines `audit suspect` "
                                           "marked as likely wrong (audited lines are kept).")
    max_dev_examples: int = arg(0, help="Use a seeded random subset of this many dev examples (0: all).")
    resume: bool = arg(False, help="Continue an interrupted run (its checkpoints are in .<out>.run beside --out) "
                                   "with the same settings: same data order, no replay.")
    save_every: int = arg(0, help="Checkpoint every N steps, so --resume loses at most N steps (0: checkpoints only "
                                  "when the dev metric improves and at the end).", speed=True)
    negatives: str = arg("sampled", help="rerank/embed from BEIR: negatives drawn at random or mined by a "
                                         "bi-encoder.", choices=("sampled", "mined"))
    num_negatives: int = arg(3, help="rerank: negatives per query (the cross-encoder sees 1 positive + N negatives), "
                                     "drawn afresh every epoch from the row's list, the mined ranks 4-30 or 8N random "
                                     "documents.")
    miner: str = arg(DEFAULT_MODEL, help="rerank/embed --negatives mined: bi-encoder folder used to mine hard "
                                         "negatives.")
    matryoshka_dims: list[int] = arg([], help="embed: also train these leading embedding sizes (Matryoshka loss), "
                                              "e.g. 64,128,256.")
    scale: float = arg(20.0, help="embed: similarity scale (1/temperature) of the in-batch contrastive loss.")
    flops_query: float = arg(3e-4, help="sparse: weight of the FLOPS regulariser on query vectors (SPLADE v2's 3e-4).")
    flops_doc: float = arg(1e-4, help="sparse: weight of the FLOPS regulariser on document vectors (SPLADE v2's 1e-4).")
    flops_warmup: int = arg(0, help="sparse: micro-batches over which the FLOPS weights rise quadratically from 0 "
                                    "(0: one epoch).")
    cross_encoder: str = arg("", help=(
        "sparse: distil from this cross-encoder (a rerank folder): every (query, positive, hard negative) row is "
        "scored by it once before training and the model learns its margins CE(q, pos) - CE(q, neg) on sparse dot "
        "products (MarginMSE, plus the FLOPS regulariser) instead of in-batch negatives; needs hard negatives "
        "(--negatives mined)."))
    no_guardrails: bool = arg(False, help="Silence every guardrail warning (see --allow).")
    allow: list[str] = arg([], help=(
        "Silence these guardrail warnings: high-lr (--lr above 1e-4, or above the task's default for the model, "
        "with nothing frozen), many-epochs (more than 4 epochs without --early-stopping), frozen-encoder (encoder "
        "layers frozen with more than 3000 examples), "
        "other-tokenizer (--tokenizer with another vocabulary than the checkpoint's), unaudited-labels (`encoderkit "
        "label` output trained on without --audit-sheet). Each warning says why it matters."))
    few_label: str = arg("auto", help=(
        "classify: the few-label route (SetFit's idea): sentence pairs from the labels tune the encoder with a "
        "cosine-similarity loss, then a logistic-regression head is fitted on the tuned embeddings. 'auto': taken when "
        f"no class has more than {few_label.MAX_PER_CLASS} training examples (single texts, one label each); 'on' / "
        "'off' force it. The route trains one pass over the pairs at its own learning rate and batch (2e-5, 16 "
        "pairs; --lr, --epochs, --batch-size, --max-steps are the standard route's); --pooling auto is mean there."),
        choices=few_label.MODES)
    pair_iterations: int = arg(20, help="classify --few-label: rounds of pairs; each pairs every training text with "
                                        "one of its class and one of another (2 x rounds x examples pairs).")
    bf16: bool | None = arg(None, help="bf16 autocast (default: on where the CPU/GPU has native bf16).", speed=True)
    bucket: bool = arg(True, help="Length-bucketed batches (less padding).", speed=True)
    eval_batch_size: int = arg(128, help="Batch size of dev evaluation.", speed=True)

    def validate(self) -> None:
        check(self.lr >= 0, "lr must be positive (or 0: the task's default)")
        check(self.batch_size >= 1, "batch_size must be at least 1")
        check(self.max_length == 0 or self.max_length >= 8, "max_length must be 0 (task default) or at least 8")
        check(self.early_stopping >= 0, "early_stopping must be 0 or more")
        check(self.pair_iterations >= 1, "pair_iterations must be at least 1")
        check(not (self.early_stopping and not self.dev), "--early-stopping needs --dev")
        guardrails.check_allowed(self.allow)


@dataclass
class FinetuneResult:
    out: Path
    task: str
    steps: int
    seconds: float
    examples_per_s: float | None  # None when no step ran in this call (a finished run resumed)
    metrics: dict[str, float]
    audit: dict[str, Any] = field(default_factory=dict)  # what --audit-sheet dropped (embed/rerank pairs)

    def summary(self) -> dict[str, Any]:
        speed = round(self.examples_per_s, 1) if self.examples_per_s is not None else None
        return {"out": str(self.out), "task": self.task, "steps": self.steps, "seconds": round(self.seconds, 1),
                "train_examples_per_s": speed, "dev": self.metrics, **({"audit": self.audit} if self.audit else {})}


class _EarlyStop(Exception):
    pass


def _identity(settings: dict[str, Any]) -> dict[str, Any]:
    """What makes a run this run: the result settings, less how it was started."""
    return {k: v for k, v in settings.items() if k not in ("resume", "overwrite", "no_guardrails", "allow")}


def task_inputs(cfg: FinetuneConfig, folder: ModelFolder) -> tuple[Any, TrainData, Any]:
    """The task object of ``--task``, what it trains on (:class:`TrainData`) and its options, each
    built once from the parsed config (which stays as given: derived values live in the options)."""
    task = get_task(cfg.task)
    options = task.options_for_training(cfg, folder)
    if cfg.cross_encoder and not hasattr(options, "cross_encoder"):  # a task whose options cannot take it
        raise EncoderkitError(f"--cross-encoder: --task {cfg.task} does not train from a cross-encoder's scores "
                              "(sparse does; an embed model learns them through `encoderkit adapt --cross-encoder`); "
                              "drop the flag")
    for flag, said, name in (("--audit-sheet", cfg.audit_sheet, "audit_sheet"),
                             ("--drop-suspected", cfg.drop_suspected, "drop_suspected")):
        if said and not hasattr(options, name):  # never ignored in silence: the labels would go unaudited
            takes = "classify, embed and rerank (a pairs file)" if name == "audit_sheet" else "classify"
            raise EncoderkitError(f"{flag}: --task {cfg.task} does not read `encoderkit label` output ({takes} "
                                  "do): drop the flag; measure the labels with `audit sample`, `audit review` and "
                                  "`audit report`, and correct the training file's wrong rows yourself")
    return task, pick(TrainData, cfg), options


def run(cfg: FinetuneConfig, build: Any = None) -> FinetuneResult:
    """Fine-tune a model on a task and write the best checkpoint as a model folder. ``build`` (default: the
    task's own ``build``) makes the :class:`~encoderkit.tasks.common.TaskRun` from the same arguments: a stage
    that trains the task's model with another loss (``adapt``'s MarginMSE) and keeps everything else."""

    out = check_output_dir(cfg.out, cfg.overwrite)
    folder = open_model(cfg.model, tokenizer=not cfg.tokenizer)
    # 0: the task's default for this model's width, settled before anything records the settings
    lr = cfg.lr or task_lr(cfg.task, config_heads_hidden(folder.config)[1])
    model_dir = folder.path
    tokenizer = folder.tokenizer(cfg.tokenizer or None)
    task, data, options = task_inputs(cfg, folder)
    # the settings as run: the settled max length, not the 0 that asked for the task's default
    settings = {**cfg.result_dict(), "max_length": options.max_length, "lr": lr}
    # ``build``: another stage's loss (the few-label route is classify's own)
    examples = None if build else few_label.route(cfg, task, data, options, folder.config.get("model_type"))
    if examples is not None:  # a few labels per class: pairs, then a head (train/few_label.py)
        _guardrails(cfg, folder, tokenizer, None, num_train=len(examples.texts))  # its own lr, one pass: not cfg's
        steps, seconds, metrics = few_label.run(cfg, examples, task, data, options, tokenizer, folder, out, settings)
        return FinetuneResult(out, cfg.task, steps, seconds, steps * few_label.BODY_BATCH / max(seconds, 1e-9),
                              metrics)
    with torch.random.fork_rng(devices=[]):  # the new head's initialisation follows --seed
        torch.manual_seed(cfg.seed)
        tr = (build or task.build)(data, options, tokenizer, folder)
    _freeze(tr.module, cfg.freeze)
    _guardrails(cfg, folder, tokenizer, tr, lr=lr)

    steps_per_epoch = max(1, len(tr.source) // cfg.grad_accum)
    train_settings = TrainSettings(
        lr=lr, weight_decay=cfg.weight_decay, warmup=cfg.warmup, schedule="linear", max_steps=cfg.max_steps,
        epochs=cfg.epochs, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, clip_norm=cfg.clip_norm,
        betas=(0.9, 0.999), eps=1e-8, eval_every=(cfg.eval_every or steps_per_epoch) if tr.evaluate else 0,
        seed=cfg.seed, bf16=cfg.bf16, log_every=max(1, min(50, steps_per_epoch // 10)), save_every=cfg.save_every,
    )
    t0 = time.perf_counter()
    stopped_early = False
    with checkpoint.run_dir_beside(out, cfg.resume) as run_dir:
        evaluate = None
        if tr.evaluate:  # said per evaluation (overfitting noted), then early stopping sees the same metrics
            said = guardrails.watch_dev(tr.evaluate, tr.primary, run_dir / "metrics.jsonl", steps_per_epoch)
            evaluate = _with_early_stopping(said, tr.primary, cfg.early_stopping)
        try:
            result = fit(tr.module, tr.loss_fn, tr.source, train_settings, run_dir, evaluate=evaluate,
                         primary=tr.primary, fingerprint={"config": _identity(settings)}, resume=cfg.resume,
                         lr_scale=tr.lr_scale)
            steps, best_metrics = result.steps, result.best_metrics
            best, start = result.best_checkpoint, result.start_step
        except _EarlyStop as stop:
            stopped_early = True
            steps, best_metrics = _last_step(run_dir / "metrics.jsonl"), stop.args[1]
            best, start = run_dir / "checkpoints" / "best", 0
    seconds = time.perf_counter() - t0
    if best is not None and (best / "model.safetensors").is_file():
        checkpoint.load_weights(tr.module, best / "model.safetensors")
    tr.module.to("cpu").eval()
    examples_per_s = (steps - start) * cfg.batch_size * cfg.grad_accum / max(seconds, 1e-9) if steps > start else None
    retry = f"rerun with --resume (the trained checkpoints are kept in {run_dir})"
    with output_dir(out, cfg.overwrite, retry=retry) as tmp, torch.no_grad():
        tr.save(tr.module, tmp)
        tokenizer.save_pretrained(tmp)
        if (run_dir / "metrics.jsonl").is_file():
            shutil.copy(run_dir / "metrics.jsonl", tmp / "metrics.jsonl")
        write_card(tmp, "finetune", model_dir, settings, {"dev": best_metrics},
                   stopped_early=stopped_early, steps=steps, train_examples=tr.num_train,
                   train_seconds=round(seconds, 1), **tr.card)
    shutil.rmtree(run_dir, ignore_errors=True)
    return FinetuneResult(out, cfg.task, steps, seconds, examples_per_s, best_metrics, tr.audit)


def _guardrails(cfg: FinetuneConfig, folder: ModelFolder, tokenizer: Any, tr: Any, num_train: int = 0,
                lr: float = 0.0) -> None:
    """Warn about settings that usually hurt (:mod:`encoderkit.train.guardrails`), unless silenced. ``tr`` None:
    the few-label route (its own learning rate and one pass: only the tokenizer and the labels' source are
    judged, over ``num_train`` examples)."""
    if cfg.no_guardrails:
        return
    differs = bool(cfg.tokenizer) and bool(folder.tokenizer_files) and guardrails.tokenizers_differ(
        folder.tokenizer(), tokenizer)
    if tr is None:
        lr, frozen, epochs, early_stopping = few_label.BODY_LR, [], 1.0, cfg.early_stopping
    else:
        steps_per_epoch = max(1, len(tr.source) // cfg.grad_accum)
        lr, frozen = lr or cfg.lr, [n for n, p in tr.module.named_parameters() if not p.requires_grad]
        epochs = cfg.max_steps / steps_per_epoch if cfg.max_steps else cfg.epochs
        early_stopping, num_train = cfg.early_stopping, tr.num_train
    found = guardrails.warnings_for(
        lr=lr, frozen=frozen, epochs=epochs, early_stopping=early_stopping, num_train=num_train,
        tokenizer_differs=differs, tokenizer=cfg.tokenizer, labelled=guardrails.labelled_output(cfg.train),
        audit_sheet=cfg.audit_sheet, default_lr=task_lr(cfg.task, config_heads_hidden(folder.config)[1]))
    guardrails.say(found, cfg.allow, cfg.no_guardrails)


def _last_step(log: Path) -> int:
    lines = log.read_text(encoding="utf-8").splitlines() if log.is_file() else []
    return int(json.loads(lines[-1])["step"]) if lines else 0


def _freeze(module, prefixes: list[str]) -> None:
    if not prefixes:
        return
    hit = set()
    for name, p in module.named_parameters():
        for pre in prefixes:
            if name.startswith(pre):
                p.requires_grad_(False)
                hit.add(pre)
    missing = [p for p in prefixes if p not in hit]
    if missing:
        names = sorted({n.rsplit(".", 2)[0] for n, _ in module.named_parameters()})[:8]
        raise EncoderkitError(f"--freeze {', '.join(missing)} matches no parameter; names start like: "
                              f"{', '.join(names)}")


def _with_early_stopping(evaluate, primary: tuple[str, str], patience: int):
    """Wrap ``evaluate`` so that ``patience`` evaluations without improvement stop training
    (the best checkpoint is already on disk when that happens)."""
    if not patience:
        return evaluate
    name, mode = primary
    state: dict[str, Any] = {"best": None, "bad": 0, "calls": 0, "best_metrics": {}}

    def wrapped(module) -> dict[str, float]:
        metrics = evaluate(module)
        state["calls"] += 1
        value = metrics[name]
        better = state["best"] is None or (value > state["best"] if mode == "max" else value < state["best"])
        if better:
            state.update(best=value, bad=0, best_metrics=metrics)
        else:
            state["bad"] += 1
            if state["bad"] >= patience:
                raise _EarlyStop(-1, state["best_metrics"])
        return metrics

    return wrapped
