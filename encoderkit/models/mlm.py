"""The masked-only MLM head: the vocabulary projection (V far larger than H) runs only on the masked positions,
(M, H) -> (M, V) instead of (B, L, V), with the same loss to float rounding.

The wrapper holds the unchanged HF model (``.model``), so saving it gives a standard ``AutoModelForMaskedLM``
folder; :class:`MaskedOnlyPreTraining` adds BERT's next-sentence objective on a ``BertForPreTraining``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from encoderkit.errors import EncoderkitError
from encoderkit.models.vocab_loss import vocab_cross_entropy

IGNORE_INDEX = -100


@dataclass
class MLMLayout:
    """Where an HF masked-LM model keeps its parts.

    encoder: the base model (``encoder(input_ids, ...)[0]`` is (B, L, H)); head: (M, H) -> (M, V);
    modules: the head's modules (what a fresh head initialises); decoder: the head's final
    ``nn.Linear`` to the vocabulary, None where the head multiplies by the word embeddings itself
    (DeBERTa-v2's non-legacy head); nsp: BERT's next-sentence classifier on the pooled output,
    (B, H) -> (B, 2), or None."""

    encoder: nn.Module
    head: Callable[[torch.Tensor], torch.Tensor]
    modules: list[nn.Module]
    decoder: nn.Linear | None
    nsp: nn.Module | None = None


def mlm_layout(model: nn.Module) -> MLMLayout:
    """The parts of an HF masked-LM (or ``BertForPreTraining``) model.

    Known layouts: BERT and legacy DeBERTa-v2 (``.cls``), ``BertForPreTraining`` (``.cls.predictions``
    + ``.cls.seq_relationship``), RoBERTa-likes (``.lm_head``), DeBERTa-v2 (``.lm_predictions``),
    ELECTRA's generator head (``.generator_predictions`` + ``.generator_lm_head``), DistilBERT
    (``.vocab_transform`` ... ``.vocab_projector``), ModernBERT (``.head`` + ``.decoder``). Other
    models raise an :class:`EncoderkitError` naming their family."""
    encoder = getattr(model, getattr(model, "base_model_prefix", ""), None)
    family = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
    if encoder is None:
        raise EncoderkitError(f"{type(model).__name__} ({family}): no base encoder found; the masked-only MLM head "
                              "needs an HF ...ForMaskedLM model")
    cls = getattr(model, "cls", None)
    if cls is not None and hasattr(cls, "seq_relationship"):  # BertForPreTraining
        return MLMLayout(encoder, cls.predictions, [cls.predictions], cls.predictions.decoder, cls.seq_relationship)
    if cls is not None:
        return MLMLayout(encoder, cls, [cls], model.get_output_embeddings())
    if hasattr(model, "lm_head"):
        return MLMLayout(encoder, model.lm_head, [model.lm_head], model.lm_head.decoder)
    if hasattr(model, "lm_predictions"):  # DeBERTa-v2: the decoder is the word embedding matrix itself
        words = encoder.embeddings.word_embeddings
        return MLMLayout(encoder, lambda h: model.lm_predictions(h, words), [model.lm_predictions], None)
    if hasattr(model, "generator_lm_head"):  # ELECTRA
        def electra(h: torch.Tensor) -> torch.Tensor:
            return model.generator_lm_head(model.generator_predictions(h))
        return MLMLayout(encoder, electra, [model.generator_predictions, model.generator_lm_head],
                         model.generator_lm_head)
    if hasattr(model, "vocab_projector"):  # DistilBERT
        def distil(h: torch.Tensor) -> torch.Tensor:
            return model.vocab_projector(model.vocab_layer_norm(model.activation(model.vocab_transform(h))))
        return MLMLayout(encoder, distil, [model.vocab_transform, model.vocab_layer_norm, model.vocab_projector],
                         model.vocab_projector)
    if hasattr(model, "head") and hasattr(model, "decoder"):  # ModernBERT
        return MLMLayout(encoder, lambda h: model.decoder(model.head(h)), [model.head, model.decoder], model.decoder)
    raise EncoderkitError(f"{type(model).__name__} ({family}): the masked-only MLM head does not know this head "
                          "layout; pretraining supports bert, roberta, deberta-v2, electra, distilbert and modernbert")


class MaskedOnlyMLM(nn.Module):
    """Training module: ``forward(input_ids, attention_mask, labels) -> (loss, correct, count)``.

    loss: mean cross-entropy over positions with ``labels != -100`` (a scalar, fp32);
    correct: how many of those the argmax predicts right (a 0-d long tensor); count: M.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self._layout = mlm_layout(model)  # a plain attribute, so the parts are not registered twice

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               token_type_ids: torch.Tensor | None) -> tuple:
        """The encoder's outputs: [0] hidden states (B, L, H), [1] the pooled (B, H) where it has a pooler.
        A mask of all ones is dropped, so that packed blocks take the attention kernels' no-mask path."""
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None
        kwargs = {"attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        return self._layout.encoder(input_ids=input_ids, **kwargs)

    def masked_loss(self, hidden: torch.Tensor, labels: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (B, L, H), labels (B, L) -> (loss, correct, count) over the M labelled positions."""
        flat_labels = labels.reshape(-1)  # (B*L,)
        picked = (flat_labels != IGNORE_INDEX).nonzero().squeeze(1)  # (M,)
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, picked)  # (M, H)
        targets = flat_labels.index_select(0, picked)  # (M,)
        logits = self._layout.head(hidden)  # (M, V)
        # fp32 cross-entropy and "the target's logit is the largest" (a tie counts as right), a slice at a time
        loss, correct = vocab_cross_entropy(logits, targets)
        return loss, correct, torch.tensor(targets.numel())

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """input_ids, labels, attention_mask, token_type_ids: (B, L)."""
        hidden = self.encode(input_ids, attention_mask, token_type_ids)[0]  # (B, L, H)
        return self.masked_loss(hidden, labels)


class MaskedOnlyPreTraining(MaskedOnlyMLM):
    """BERT's two objectives: the masked-only MLM loss plus next-sentence prediction.

    ``forward(input_ids, labels, attention_mask, token_type_ids, next_sentence_label)`` ->
    ``(loss, correct, count, nsp_loss, nsp_correct)``: loss = MLM loss + NSP loss (BERT sums them);
    next_sentence_label (B,) is 0 where segment B follows A, 1 where it is random (HF's convention).
    The model must be a ``BertForPreTraining``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        if self._layout.nsp is None:
            family = getattr(model.config, "model_type", type(model).__name__)
            raise EncoderkitError(f"{family}: next-sentence prediction needs BERT's pretraining heads "
                                  f"(BertForPreTraining), not {type(model).__name__}")

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        next_sentence_label: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.encode(input_ids, attention_mask, token_type_ids)
        loss, correct, count = self.masked_loss(out[0], labels)
        nsp_logits = self._layout.nsp(out[1])  # (B, 2) from the pooled [CLS] state
        nsp_loss = F.cross_entropy(nsp_logits.float(), next_sentence_label)
        nsp_correct = (nsp_logits.detach().argmax(-1) == next_sentence_label).sum()
        return loss + nsp_loss, correct, count, nsp_loss.detach(), nsp_correct


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


def mlm_nsp_loss_fn(module: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    """Engine loss function for a (possibly DDP-wrapped) :class:`MaskedOnlyPreTraining`."""
    loss, correct, count, nsp_loss, nsp_correct = module(
        batch["input_ids"], batch["labels"], batch.get("attention_mask"), batch["token_type_ids"],
        batch["next_sentence_label"],
    )
    return loss, {"acc": float(correct) / max(1, int(count)), "nsp_loss": float(nsp_loss),
                  "nsp_acc": float(nsp_correct) / len(batch["next_sentence_label"])}


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


@torch.no_grad()
def evaluate_nsp(module: MaskedOnlyPreTraining, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Held-out next-sentence metrics over fixed pair batches: ``nsp_loss`` (example-weighted) and
    ``nsp_accuracy``."""
    device = next(module.parameters()).device
    total_loss, total_correct, total = 0.0, 0, 0
    for batch in batches:
        b = {k: v.to(device) for k, v in batch.items()}
        _, _, _, nsp_loss, nsp_correct = module(b["input_ids"], b["labels"], b.get("attention_mask"),
                                                b["token_type_ids"], b["next_sentence_label"])
        n = len(b["next_sentence_label"])
        total_loss += float(nsp_loss) * n
        total_correct += int(nsp_correct)
        total += n
    return {"nsp_loss": total_loss / max(1, total), "nsp_accuracy": total_correct / max(1, total)}
