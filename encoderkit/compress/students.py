"""Students for every distillation recipe (from chosen teacher layers, narrower and random, or a given folder),
the shared soft-target losses and the result every recipe returns. The distill modules all build on this one,
so none of them imports another.
"""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from encoderkit.config import check
from encoderkit.errors import EncoderkitError
from encoderkit.io import check_output_dir, output_dir
from encoderkit.models.anatomy import ANATOMIES
from encoderkit.models.card import write_card
from encoderkit.models.folder import ModelFolder
from encoderkit.models.pooling import apply_pooling
from encoderkit.models.tokenizer import load_tokenizer
from encoderkit.progress import note
from encoderkit.train import engine
from encoderkit.train.checkpoint import run_dir_beside

# -- student construction --------------------------------------------------------------------------

_LAYER_KEY = re.compile(r"(^|\.)layers?\.(\d+)\.")  # encoder.layer.N (BERT-like), model.layers.N (ModernBERT)


def parse_layer_map(spec: str | list[int] | None, n_teacher: int) -> list[int]:
    """Teacher layer indices the student keeps, in order: ``"every-other"`` (0, 2, 4, ...: DistilBERT's half
    depth spread over the stack), or exactly the layers of ``"0,2,5"`` / ``[0, 2, 5]``."""
    if spec is None or spec == "every-other":
        return list(range(0, n_teacher, 2))
    if isinstance(spec, str):
        parts = [p for p in re.split(r"[,\s\[\]]+", spec) if p]
        try:
            layers = [int(p) for p in parts]
        except ValueError as e:
            raise EncoderkitError(f"layers={spec!r}: expected 'every-other' or teacher layer numbers "
                                  "like '0,2,4'") from e
    else:
        layers = [int(x) for x in spec]
    check(len(layers) > 0, "layers: the student needs at least one layer")
    bad = [i for i in layers if not 0 <= i < n_teacher]
    check(not bad, f"layers={layers}: the teacher has layers 0..{n_teacher - 1}; {bad} do not exist")
    check(len(set(layers)) == len(layers), f"layers={layers}: each teacher layer may be used once")
    return layers


def student_state_from_teacher(teacher_state: dict[str, torch.Tensor], layers: list[int]) -> dict[str, torch.Tensor]:
    """The teacher's state dict with encoder layer ``layers[i]`` renamed to layer ``i`` and the
    other layers dropped; embeddings, pooler and heads are kept as they are."""
    where = {t: s for s, t in enumerate(layers)}
    out: dict[str, torch.Tensor] = {}
    for key, value in teacher_state.items():
        m = _LAYER_KEY.search(key)
        if m is None:
            out[key] = value.clone()
            continue
        t = int(m.group(2))
        if t in where:
            new_key = key[: m.start(2)] + str(where[t]) + key[m.end(2):]
            out[new_key] = value.clone()
    return out


def build_student_from_teacher(teacher: nn.Module, layers: list[int]) -> nn.Module:
    """A copy of ``teacher``'s architecture with ``len(layers)`` layers, initialised from the
    teacher's layers ``layers`` (plus embeddings, pooler and heads)."""
    settings = teacher.config.to_dict()
    if isinstance(settings.get("layer_types"), list):  # per-layer attention (ModernBERT: global or sliding window)
        settings["layer_types"] = [settings["layer_types"][i] for i in layers]  # as the layers copied had it
        settings["num_hidden_layers"] = len(layers)  # checked against layer_types when the config is built
    config = teacher.config.__class__.from_dict(settings)
    config.num_hidden_layers = len(layers)
    student = apply_pooling(type(teacher)(config))
    state = student_state_from_teacher(teacher.state_dict(), layers)
    # a layer whose place in the stack decides whether it has a norm (ModernBERT's first layer has no attention
    # norm: the embeddings' norm comes just before it): a teacher layer moved to or from that place drops its norm,
    # or gets a fresh one (identity at init); distillation trains the student from there
    modules = dict(student.named_modules())
    moved = [k for k in state if isinstance(modules.get(k.rpartition(".")[0]), nn.Identity)]
    for key in moved:
        del state[key]
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if "position_ids" not in k]
    fresh = [k for k in missing if isinstance(modules.get(k.rpartition(".")[0]), nn.LayerNorm)]
    missing = [k for k in missing if k not in fresh]
    if moved or fresh:
        note(f"distill: layers {layers} move a teacher layer to or from a place whose norm the family fixes: "
             f"left out {moved[:4]}, new (identity) {fresh[:4]}")
    if missing or unexpected:
        family = getattr(teacher.config, "model_type", type(teacher).__name__)
        raise EncoderkitError(
            f"distill: {family} teachers are not supported: cannot initialise the student from the teacher's layers "
            f"({type(teacher).__name__}): missing {missing[:5]}, unexpected {unexpected[:5]}; use a BERT-style "
            "teacher or pass --student FOLDER"
        )
    return student


def build_narrow_student(teacher: nn.Module, hidden_size: int, num_layers: int, generator_seed: int) -> nn.Module:
    """A randomly initialised student of the teacher's class with a smaller width.

    Heads keep the teacher's head size where it divides ``hidden_size``; FFN width is 4x hidden.
    """
    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    head_dim = teacher.config.hidden_size // teacher.config.num_attention_heads
    check(hidden_size % head_dim == 0 or hidden_size % 4 == 0,
          f"hidden_size={hidden_size}: must be a multiple of the head size {head_dim} or of 4")
    config.hidden_size = hidden_size
    config.num_attention_heads = hidden_size // head_dim if hidden_size % head_dim == 0 else 4
    # under the family's own key (DistilBERT's hidden_dim: an intermediate_size there would be ignored)
    found = ANATOMIES.get(config.model_type)
    setattr(config, found.ffn_key if found else "intermediate_size", 4 * hidden_size)
    config.num_hidden_layers = num_layers
    fork = torch.random.fork_rng(devices=[])  # module init draws from the global RNG; leave it as found
    with fork:
        torch.manual_seed(generator_seed)
        return apply_pooling(type(teacher)(config))


def check_same_tokenizer(teacher_dir: str | Path, student_dir: str | Path) -> None:
    """Raise unless both folders hold the same vocabulary (same tokens at the same ids)."""
    t, s = load_tokenizer(teacher_dir), load_tokenizer(student_dir)
    tv, sv = t.get_vocab(), s.get_vocab()
    if tv != sv:
        only_t = sorted(set(tv) - set(sv))[:5]
        only_s = sorted(set(sv) - set(tv))[:5]
        moved = sorted(k for k in set(tv) & set(sv) if tv[k] != sv[k])[:5]
        raise EncoderkitError(
            f"teacher {teacher_dir} and student {student_dir} use different tokenizers "
            f"({len(tv)} vs {len(sv)} tokens; only in teacher: {only_t}, only in student: {only_s}, "
            f"different ids: {moved}); distillation compares outputs token by token, so give the student "
            "the teacher's tokenizer (copy its tokenizer files) or let distill build the student"
        )
    if getattr(t, "do_lower_case", None) != getattr(s, "do_lower_case", None):
        raise EncoderkitError(f"teacher {teacher_dir} and student {student_dir} differ in lower-casing; "
                              "use the same tokenizer")


def check_same_task(teacher_dir: str | Path, student_dir: str | Path) -> None:
    """Raise unless teacher and student folders are models of the same task (a one-label cross-encoder
    and a classifier share a head class, so the class alone does not tell)."""
    t = ModelFolder.open(teacher_dir, weights=False, tokenizer=False).task
    s = ModelFolder.open(student_dir, weights=False, tokenizer=False).task
    if t != s:
        raise EncoderkitError(f"student {student_dir} is a {s} model but the teacher {teacher_dir} a {t} model; "
                              f"distillation needs a student of the teacher's task ({t}): pass a {t} student or "
                              "let distill build one from the teacher")


# -- losses ----------------------------------------------------------------------------------------

def soft_target_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher_T || student_T) * T^2 of (N, C) logits, averaged over rows; T^2 keeps the gradient scale
    independent of the temperature (Hinton et al. 2015). Zero when the logits are equal."""
    if student_logits.numel() == 0:
        return student_logits.sum() * 0.0
    t = temperature
    log_p_s = F.log_softmax(student_logits.float() / t, dim=-1)
    log_p_t = F.log_softmax(teacher_logits.float() / t, dim=-1)
    return F.kl_div(log_p_s, log_p_t, reduction="batchmean", log_target=True) * (t * t)


MULTI_LABEL = "multi_label_classification"  # config.json ``problem_type`` of a head with a sigmoid per label


def is_multi_label(model_or_config: Any) -> bool:
    """Whether a model (or its config, or a config.json dict) is a multi-label classifier: a sigmoid per
    label, not one softmax."""
    config = getattr(model_or_config, "config", model_or_config)
    if isinstance(config, dict):
        return config.get("problem_type") == MULTI_LABEL
    return getattr(config, "problem_type", None) == MULTI_LABEL


def sigmoid_target_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The multi-label counterpart of :func:`soft_target_kl` on (N, C) logits, a sigmoid per label: ``T^2`` * the
    mean of each label's Bernoulli KL. Zero when the logits are equal; it sees a shift of all logits together."""
    if student_logits.numel() == 0:
        return student_logits.sum() * 0.0
    t = temperature
    s, tt = student_logits.float() / t, teacher_logits.float() / t
    target = torch.sigmoid(tt)
    kl = (F.binary_cross_entropy_with_logits(s, target, reduction="none")
          - F.binary_cross_entropy_with_logits(tt, target, reduction="none"))
    return kl.mean() * (t * t)


@dataclass
class DistillResult:
    out: Path
    layers: list[int] | None
    teacher_params: int
    student_params: int
    steps: int
    train_logs: dict[str, float]
    skipped_links: int | None = None  # a --train corpus folder's links that leave it, left out; None: no corpus read

    def summary(self) -> dict[str, Any]:
        return {"out": str(self.out), "layers_from_teacher": self.layers, "teacher_params": self.teacher_params,
                "student_params": self.student_params, "steps": self.steps,
                "final_losses": {k: round(v, 4) for k, v in self.train_logs.items()},
                **({} if self.skipped_links is None else {"skipped_links": self.skipped_links})}


def make_student(cfg: Any, teacher: nn.Module) -> tuple[nn.Module, list[int] | None]:
    """The student (``--student`` folder, a narrower random one, or the teacher's chosen layers) and
    the teacher layers it was initialised from (None unless taken from the teacher)."""
    n_teacher = teacher.config.num_hidden_layers
    if cfg.student:
        check_same_tokenizer(cfg.teacher, cfg.student)
        check_same_task(cfg.teacher, cfg.student)
        student = ModelFolder.open(cfg.student, tokenizer=False).load()
        check(type(student) is type(teacher),
              f"student {cfg.student} is a {type(student).__name__} but the teacher a {type(teacher).__name__}; "
              "use the same head")
        return student, None
    if cfg.hidden_size:
        n = len(parse_layer_map(cfg.layers, n_teacher))
        return build_narrow_student(teacher, cfg.hidden_size, n, cfg.seed), None
    layers = parse_layer_map(cfg.layers, n_teacher)
    return build_student_from_teacher(teacher, layers), layers


def fit_and_save(cfg: Any, module: nn.Module, loss_fn: Any, source: Any, save: Any, *, examples: int,
                 layers: list[int] | None, facts: dict[str, Any]) -> Any:
    """The tail every recipe shares: train ``module``, write the student with ``save(folder)`` and a distill
    card carrying ``facts``; returns the fit result. Checkpoints live in ``.<out>.run`` beside ``cfg.out`` until
    the run finishes, so ``cfg.resume`` continues an interrupted run."""
    settings = engine.TrainSettings(lr=cfg.lr, warmup=cfg.warmup, max_steps=cfg.max_steps, epochs=cfg.epochs,
                             batch_size=cfg.batch_size, seed=cfg.seed, bf16=cfg.bf16, log_every=10,
                             save_every=getattr(cfg, "save_every", 0))
    out = check_output_dir(cfg.out, cfg.overwrite)
    resume = getattr(cfg, "resume", False)
    identity = {k: v for k, v in cfg.result_dict().items() if k != "overwrite"}
    with run_dir_beside(out, resume) as run_dir:
        res = engine.fit(module, loss_fn, source, settings, run_dir, fingerprint={"stage": "distill", **identity},
                         resume=resume)
    with output_dir(out, cfg.overwrite, retry=f"rerun with --resume (the checkpoints are kept in {run_dir})") as tmp:
        save(tmp)
        metrics = {"train_" + k: v for k, v in res.train_logs.items()}
        write_card(tmp, "distill", cfg.teacher, cfg.result_dict(),
                   {**metrics, "examples": examples, "steps": res.steps}, layers_from_teacher=layers, **facts)
    shutil.rmtree(run_dir, ignore_errors=True)
    return res
