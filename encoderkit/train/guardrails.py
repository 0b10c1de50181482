"""Fine-tuning guardrails: warnings for settings that usually hurt, each with its reason and the flag that silences
it, and the dev metric said per evaluation with a note when it falls while the training loss keeps falling.

The rules (``--allow RULE`` silences one, ``--no-guardrails`` all):

- ``high-lr``: a peak LR above 1e-4 (or above the task's own default for the model's width, where that is higher:
  narrow models train QA and rerank at 2e-4) with nothing frozen: full fine-tuning at such a rate tends to wreck what
  the pretrained weights knew (catastrophic forgetting); 1e-5 to 5e-5 is the usual range on base-sized models;
- ``many-epochs``: more than 4 epochs without ``--early-stopping``: a pretrained encoder fits a task in 2-4 passes
  and then memorises the training set;
- ``frozen-encoder``: transformer layers frozen with more than :data:`FROZEN_MAX` training examples: with that
  much data, training the whole encoder usually scores clearly higher than a head on frozen features;
- ``other-tokenizer``: ``--tokenizer`` with another vocabulary than the checkpoint's: the embedding rows were
  learned for the checkpoint's token ids, so other ids read other (or untrained) rows;
- ``unaudited-labels``: training on ``encoderkit label`` output (its ledger beside the file, or a ``labeller``
  field on its lines) without ``--audit-sheet``: the labeller's mistakes are learnt as truth, unmeasured.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from encoderkit.errors import EncoderkitError
from encoderkit.io import read_lines, records
from encoderkit.progress import note

RULES = ("high-lr", "many-epochs", "frozen-encoder", "other-tokenizer", "unaudited-labels")
MAX_LR = 1e-4
MAX_EPOCHS = 4
FROZEN_MAX = 3000  # "a few thousand" training examples
_BLOCK = re.compile(r"(^|\.)(layer|layers|h|blocks)\.\d+\.")  # a transformer block's parameters, in any family


@dataclass(frozen=True)
class Warning_:
    rule: str
    reason: str

    def message(self) -> str:
        return f"finetune: warning: {self.reason} (silence: --allow {self.rule}, or --no-guardrails)"


def check_allowed(allow: list[str]) -> None:
    unknown = [a for a in allow if a not in RULES]
    if unknown:
        raise EncoderkitError(f"--allow {' '.join(unknown)}: not a guardrail; the rules are {', '.join(RULES)}")


def labelled_output(path: str) -> bool:
    """Whether ``path`` was written by ``encoderkit label``: its ledger lies beside it, or its first JSON line has a
    ``labeller`` field."""
    p = Path(path)
    if Path(f"{path}.ledger.json").is_file():
        return True
    if p.suffix not in (".jsonl", ".json") or not p.is_file():
        return False
    try:
        for _, line in records(read_lines(p, "--train"), str(p)):  # the one line reader; its errors are the reader's
            rec = json.loads(line)
            return isinstance(rec, dict) and "labeller" in rec
    except (EncoderkitError, json.JSONDecodeError):
        return False  # what is wrong with the file is said by the task reader, with its line
    return False


def warnings_for(*, lr: float, frozen: list[str], epochs: float, early_stopping: int, num_train: int,
                 tokenizer_differs: bool, tokenizer: str, labelled: bool, audit_sheet: str,
                 default_lr: float = 0.0) -> list[Warning_]:
    """The guardrails that apply (see the module docstring); ``frozen``: names of the frozen parameters,
    ``epochs``: the passes the run will make (``--max-steps`` counted in epochs); ``default_lr``: the task's own
    rate for this model (never warned about)."""
    out = []
    limit = max(MAX_LR, default_lr)
    if lr > limit and not frozen:
        usual = (f"{default_lr:g} is this task's default for this model" if default_lr > MAX_LR
                 else "1e-5 to 5e-5 is the usual range")
        out.append(Warning_("high-lr", f"--lr {lr:g} is above {limit:g} on full fine-tuning, which tends to wreck "
                                       f"what the pretrained weights knew; {usual}"))
    if epochs > MAX_EPOCHS and not early_stopping:
        out.append(Warning_("many-epochs", f"{epochs:g} epochs without --early-stopping: a pretrained encoder fits a "
                                           f"task in 2-{MAX_EPOCHS} passes, then memorises the training set; give "
                                           "--dev with --early-stopping 2, or fewer --epochs"))
    blocks = [n for n in frozen if _BLOCK.search(n)]
    if blocks and num_train > FROZEN_MAX:
        out.append(Warning_("frozen-encoder", f"encoder layers are frozen ({len(blocks)} tensors, e.g. {blocks[0]}) "
                                              f"with {num_train} training examples: above {FROZEN_MAX} training the "
                                              "whole encoder usually scores clearly higher; drop --freeze"))
    if tokenizer_differs:
        out.append(Warning_("other-tokenizer", f"--tokenizer {tokenizer} is not the checkpoint's own (another "
                                               "vocabulary): the embeddings were learnt for the checkpoint's token "
                                               "ids; drop --tokenizer"))
    if labelled and not audit_sheet:
        out.append(Warning_("unaudited-labels", "the training file is `encoderkit label` output and no --audit-sheet "
                                                "is given: the labeller's mistakes are learnt as truth, unmeasured; "
                                                "audit it (audit sample, review, report) first"))
    return out


def say(warnings: list[Warning_], allow: list[str], off: bool) -> list[Warning_]:
    """Print the warnings not silenced; returns them."""
    shown = [] if off else [w for w in warnings if w.rule not in allow]
    for w in shown:
        note(w.message())
    return shown


def tokenizers_differ(own: Any, other: Any) -> bool:
    return own.get_vocab() != other.get_vocab()


def watch_dev(evaluate: Callable[[Any], dict[str, float]], primary: tuple[str, str], log: Path,
              steps_per_epoch: int) -> Callable[[Any], dict[str, float]]:
    """``evaluate`` that also says the dev metric, the epoch and the training loss since the previous evaluation
    (read from the run's ``metrics.jsonl``), and notes when the metric got worse while that loss kept falling."""
    name, mode = primary
    state: dict[str, Any] = {"seen": 0, "value": None, "loss": None}

    def wrapped(module: Any) -> dict[str, float]:
        metrics = evaluate(module)
        value = metrics.get(name)
        step, loss = _train_loss_since(log, state["seen"])
        state["seen"] = step
        shown = "n/a" if value is None else f"{value:.4f}"
        said = f"finetune: epoch {step / max(steps_per_epoch, 1):.3g} (step {step}): dev {name} {shown}"
        note(said + ("" if loss is None else f", train loss {loss:.4f}"))
        prev_v, prev_l = state["value"], state["loss"]
        if None not in (value, loss, prev_v, prev_l):
            worse = value < prev_v if mode == "max" else value > prev_v
            if worse and loss < prev_l:
                note(f"finetune: note: dev {name} fell from {prev_v:.4f} to {value:.4f} while the training loss kept "
                     f"falling ({prev_l:.4f} -> {loss:.4f}): the model is starting to overfit; the best checkpoint "
                     "is the one kept, and fewer --epochs or --early-stopping stop sooner")
        state.update(value=value, loss=loss)
        return metrics

    return wrapped


def _train_loss_since(log: Path, after: int) -> tuple[int, float | None]:
    """(the last logged step, the mean training loss of the records logged after step ``after``)."""
    if not log.is_file():
        return after, None
    losses, step = [], after
    for line in log.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        if "loss" in rec and rec.get("step", 0) > after:
            losses.append(float(rec["loss"]))
            step = max(step, int(rec["step"]))
    return step, (sum(losses) / len(losses) if losses else None)
