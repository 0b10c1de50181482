"""The masked-only MLM head: the vocabulary projection runs only where there is something to
predict.

A standard MLM forward pass projects every position to the vocabulary: (B, L, H) -> (B, L, V).
With 15-30 % of positions masked, and V (30k) far larger than H (256-768), that projection and
its softmax are most of the step's work and memory. :class:`MaskedOnlyMLM` runs the encoder,
gathers the hidden states of the masked positions, (B, L, H) -> (M, H), and applies the head's
transform and decoder there only, (M, H) -> (M, V). The loss is the same cross-entropy over the
same positions, so it equals the full head's loss (up to float rounding).

The wrapper holds the unchanged HF model (``.model``), whose state dict keys stay those of
``BertForMaskedLM`` (or ``RobertaForMaskedLM`` / ``ModernBertForMaskedLM``): saving
``wrapper.model`` gives a standard folder for ``AutoModelForMaskedLM`` and ``pipeline("fill-mask")``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def split_mlm(model: nn.Module) -> tuple[nn.Module, Callable[[torch.Tensor], torch.Tensor]]:
    """``(encoder, head)`` of an HF masked-LM model: ``encoder(input_ids, attention_mask, ...)``
    returns hidden states (B, L, H) first; ``head`` maps (M, H) -> (M, V).

    Known layouts: BERT-likes (``.cls``), RoBERTa-likes (``.lm_head``), ModernBERT (``.head`` +
    ``.decoder``). Raises ``TypeError`` for other models."""
    encoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if encoder is None:
        raise TypeError(f"{type(model).__name__}: no base encoder found")
    if hasattr(model, "cls"):
        return encoder, model.cls
    if hasattr(model, "lm_head"):
        return encoder, model.lm_head
    if hasattr(model, "head") and hasattr(model, "decoder"):
        return encoder, lambda h: model.decoder(model.head(h))
    raise TypeError(f"{type(model).__name__}: unknown masked-LM head layout")


class MaskedOnlyMLM(nn.Module):
    """Training module: ``forward(input_ids, attention_mask, labels) -> (loss, correct, count)``.

    loss: mean cross-entropy over positions with ``labels != -100`` (a scalar, fp32);
    correct: how many of those the argmax predicts right (a 0-d long tensor); count: M.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._parts = split_mlm(model)  # a tuple, so the parts are not registered twice

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, labels, attention_mask: (B, L). A mask of all ones is dropped, so that packed
        blocks take the attention kernels' no-mask path."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        kwargs = {"attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        encoder, head = self._parts
        hidden = encoder(input_ids=input_ids, **kwargs)[0]  # (B, L, H)
        flat_labels = labels.reshape(-1)  # (B*L,)
        picked = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, picked)  # (M, H)
        targets = flat_labels.index_select(0, picked)  # (M,)
        logits = head(hidden)  # (M, V)
        loss = F.cross_entropy(logits.float(), targets)
        correct = (logits.detach().argmax(-1) == targets).sum()
        return loss, correct, torch.tensor(targets.numel())


def full_head_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                   attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: the HF model's own loss with the head over every position, (B, L, V)."""
    return model(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss


def mlm_loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Engine loss function for a (possibly DDP-wrapped) :class:`MaskedOnlyMLM`."""
    loss, correct, count = module(
        batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch.get("token_type_ids")
    )
    return loss, {"acc": float(correct) / max(1, int(count))}


@torch.no_grad()
def evaluate_mlm(mlm: MaskedOnlyMLM, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Held-out metrics over fixed masked batches: token-weighted ``loss``, ``accuracy`` of
    masked-token prediction and ``perplexity`` = exp(loss)."""
    device = next(mlm.parameters()).device
    total_loss, total_correct, total = 0.0, 0, 0
    for batch in batches:
        loss, correct, count = mlm(
            batch["input_ids"].to(device), batch["labels"].to(device),
            batch["attention_mask"].to(device) if "attention_mask" in batch else None,
        )
        n = int(count)
        total_loss += float(loss) * n
        total_correct += int(correct)
        total += n
    mean = total_loss / max(1, total)
    return {"loss": mean, "accuracy": total_correct / max(1, total), "perplexity": float(torch.tensor(mean).exp())}
