"""SPLADE: an MLM head used as a retriever. A text's vector (B, V) is the max over its real tokens of
``log(1 + relu(MLM logits))``; a score is the dot product of two vectors.

The saturation rises monotonically, so the max is taken on the logits first (the same number and gradient,
SPLADE-max) and torch runs the head over chunks of tokens, so the (B, T, V) logits never exist at once. A folder
without an MLM head gets its family's head tied to the word embeddings, with a transform that starts as the identity.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import AutoModelForMaskedLM

from encoderkit.errors import EncoderkitError
from encoderkit.io import write_json_atomic
from encoderkit.models.folder import ModelFolder, task_from_config
from encoderkit.models.mlm import mlm_layout
from encoderkit.tasks.margin_mse import margin_mse

OUTPUT = "sparse_vector"  # the graph's one output: the pooled vector (B, V)
CHUNK = 256  # tokens per head call in torch (a running max over chunks past it; bf16 runs one call fastest)
FRESH_TERMS = 200  # a fresh head starts with about this many non-zero weights per training document


def saturate(max_logits: torch.Tensor) -> torch.Tensor:
    """``log(1 + relu(x))`` of the max logits (B, V), in float32."""
    return torch.log1p(torch.relu(max_logits.float()))


def masked(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Logits (B, T, V) with padding positions at the dtype's lowest value (never a max, and 0 once saturated)."""
    return logits.masked_fill(attention_mask[:, :, None] == 0, torch.finfo(logits.dtype).min)


class Splade(nn.Module):
    """An HF masked-LM model (``.model``, saved as it is) as a SPLADE encoder: token ids (B, T) -> vectors (B, V).

    ``forward`` returns ``{"sparse_vector": (B, V) float32}``, the one output of the task's graph. ``flops_step``
    counts training micro-batches (the FLOPS warm-up), kept in checkpoints so a resumed run continues it."""

    def __init__(self, model: nn.Module, chunk: int = CHUNK) -> None:
        super().__init__()
        self.model = model
        self.chunk = chunk
        self._layout = mlm_layout(model)  # a plain attribute: the parts are registered once, under .model
        self.register_buffer("flops_step", torch.zeros((), dtype=torch.long))

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        return {OUTPUT: saturate(self.max_logits(input_ids, attention_mask, token_type_ids))}

    def max_logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Each vocabulary entry's largest logit over the real tokens (B, V), before the saturation."""
        kw = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        hidden = self._layout.encoder(input_ids=input_ids, attention_mask=attention_mask, **kw)[0]  # (B, T, H)
        head = self._layout.head
        # a traced (ONNX) graph runs the head whole: a chunk loop would be unrolled into it
        if not self.chunk or torch.jit.is_tracing() or hidden.shape[1] <= self.chunk:
            best = masked(head(hidden), attention_mask).max(dim=1).values  # (B, V)
        else:
            best = None
            for a in range(0, hidden.shape[1], self.chunk):
                cut = slice(a, a + self.chunk)
                part = masked(head(hidden[:, cut]), attention_mask[:, cut]).max(dim=1).values
                best = part if best is None else torch.maximum(best, part)
        return best


def flops(w: torch.Tensor) -> torch.Tensor:
    """The FLOPS regulariser of a batch of vectors (N, V): ``sum_j (mean_i |w_ij|)^2`` (Paria et al. 2020)."""
    return (w.abs().mean(dim=0) ** 2).sum()


def warmup_factor(step: int, warmup: int) -> float:
    """SPLADE's quadratic warm-up of the FLOPS weights: ``min(1, (step / warmup)^2)`` (1 without warm-up)."""
    return 1.0 if warmup <= 0 else min(1.0, (step / warmup) ** 2)


def contrastive_loss(q: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """q (B, V), docs (B*(1+k), V) with row i's positive at index i: cross-entropy of ``q @ docs.T``."""
    target = torch.arange(q.shape[0], device=q.device)
    return nn.functional.cross_entropy(q.float() @ docs.float().T, target)


def splade_loss(q: torch.Tensor, docs: torch.Tensor, lambda_q: float, lambda_d: float,
                margins: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss (the ranking part + weighted FLOPS of queries and documents) and what to log: the
    ranking part, and the mean non-zero weights per query and per document. The ranking part is contrastive, or
    with a cross-encoder's ``margins`` (B, k) MarginMSE on dot products (docs: the B positives, then row i's k
    negatives at B + i*k ...)."""
    if margins is None:
        rank, name = contrastive_loss(q, docs), "ce"
    else:
        rank, name = margin_mse(q.float(), docs.float(), margins, 1.0), "margin_mse"
    loss = rank + lambda_q * flops(q) + lambda_d * flops(docs)
    with torch.no_grad():
        logs = {name: float(rank), "q_nnz": float((q > 0).sum(1).float().mean()),
                "d_nnz": float((docs > 0).sum(1).float().mean())}
    return loss, logs


# -- the head --------------------------------------------------------------------------------------

def has_mlm_head(folder: ModelFolder) -> bool:
    """Whether the folder's weights hold an MLM head: a ``*ForMaskedLM`` / ``*ForPreTraining`` model (what the
    folder reader calls an ``mlm`` folder), or a sparse folder."""
    return task_from_config(folder.config) == "mlm"


def load_mlm(folder: ModelFolder) -> tuple[nn.Module, str]:
    """The folder as an HF masked-LM model and how its head was made (the card's ``head``): the folder's own
    MLM head, or (no head in the weights) the word embeddings as the decoder and a fresh identity transform."""
    if folder.static_weights is not None or folder.torch_weights is None:
        what = "a static embedding table" if folder.static_weights is not None else "an ONNX-only folder"
        raise EncoderkitError(f"{folder.path} is {what}: SPLADE needs a transformer with torch weights "
                              "(model.safetensors) whose token states an MLM head can read")
    if folder.quantization is not None or folder.kept_heads is not None:
        raise EncoderkitError(f"{folder.path} is quantized or head-pruned; fine-tune SPLADE from the folder it was "
                              "made from, then compress")
    family = folder.config.get("model_type", "?")
    own = has_mlm_head(folder)
    try:
        model = folder.load(AutoModelForMaskedLM)
    except EncoderkitError as e:
        raise EncoderkitError(f"{folder.path}: a {family!r} model has no masked-LM head class in transformers, so "
                              f"SPLADE cannot read vocabulary logits from it ({e}); start from a BERT-family encoder "
                              "(BERT, RoBERTa, DistilBERT, DeBERTa-v2, ELECTRA, ModernBERT)") from e
    layout = mlm_layout(model)
    if own:
        return model, "the folder's own MLM head"
    if layout.decoder is None:  # DeBERTa-v2's head multiplies by the word embeddings itself
        head_modules = layout.modules
        how = "the family's head (decoder = the word embeddings) with a fresh transform"
    else:
        words = model.get_input_embeddings()
        if layout.decoder.weight.shape != words.weight.shape:
            raise EncoderkitError(f"{folder.path}: the {family!r} MLM decoder {tuple(layout.decoder.weight.shape)} "
                                  f"does not match the word embeddings {tuple(words.weight.shape)}; cannot tie them")
        layout.decoder.weight = words.weight  # tied: the decoder is the embedding matrix
        model.config.tie_word_embeddings = True
        head_modules = [m for m in layout.modules if m is not layout.decoder]
        how = "tied word embeddings as the decoder, a fresh transform initialised as the identity"
    _identity_transform(head_modules, layout.decoder)
    with torch.no_grad():
        for bias in vocabulary_biases(model):
            bias.zero_()
    return model, how


@torch.no_grad()
def _identity_transform(modules: Sequence[nn.Module], decoder: nn.Module | None) -> None:
    """A fresh head transform that starts as the identity: square Linear layers I / 0 and LayerNorms 1 / 0 (the
    decoder weight, tied to the embeddings, is left alone)."""
    for root in modules:
        for m in root.modules():
            if m is decoder:
                continue
            if isinstance(m, nn.Linear) and m.weight.shape[0] == m.weight.shape[1]:
                m.weight.copy_(torch.eye(m.weight.shape[0]))
                if m.bias is not None:
                    m.bias.zero_()
            elif isinstance(m, nn.LayerNorm):
                if m.weight is not None:
                    m.weight.fill_(1.0)
                if m.bias is not None:
                    m.bias.zero_()


def vocabulary_biases(model: nn.Module) -> list[nn.Parameter]:
    """The head's per-token output biases (V,) (BERT keeps one on the head, tied to the decoder's)."""
    layout = mlm_layout(model)
    vocab = int(model.config.vocab_size)
    found: dict[int, nn.Parameter] = {}
    for root in [*layout.modules, *([layout.decoder] if layout.decoder is not None else [])]:
        for name, p in root.named_parameters():
            if name.endswith("bias") and p.dim() == 1 and p.shape[0] == vocab:
                found[id(p)] = p
    return list(found.values())


@torch.no_grad()
def start_sparse(module: Splade, batch: dict[str, torch.Tensor], special_ids: Sequence[int],
                 terms: int = FRESH_TERMS) -> float:
    """Give a fresh head a threshold, so its vectors start sparse: the identity transform makes most entries of a
    document's max logits positive (every vector dense). The output biases become ``-t``, with ``t`` the median over
    ``batch`` (documents) of each one's ``terms``-th largest max logit, so a document starts with about ``terms``
    non-zero weights (the FLOPS regulariser takes over from there); special tokens ([CLS], [SEP], ...) start far
    below (they say nothing of a text). Returns ``t``."""
    was = module.training
    module.eval()
    try:
        best = module.max_logits(**batch).float()  # (B, V), biases 0
    finally:
        module.train(was)
    k = min(terms, best.shape[1])
    t = float(torch.topk(best, k, dim=1).values[:, -1].median())
    for bias in vocabulary_biases(module.model):
        bias.fill_(-t)
        ids = [i for i in special_ids if 0 <= i < bias.shape[0]]
        bias[ids] = -t - 100.0
    return t


def check_vocabulary(tokenizer: Any, model: nn.Module, where: Path) -> None:
    """A vector entry is a token of the tokenizer: refuse a tokenizer with tokens the model's vocabulary lacks."""
    n, v = len(tokenizer), int(model.config.vocab_size)
    if n > v:
        raise EncoderkitError(f"{where}: the tokenizer has {n} tokens but the model's vocabulary {v}; SPLADE weights "
                              "are per vocabulary entry, so the tokenizer must be the model's own (drop --tokenizer or "
                              "pass the one the model was trained with)")


def save_sparse_encoder(module: Splade, folder: Path, max_length: int) -> None:
    """The HF masked-LM files plus sentence-transformers' SparseEncoder files (MLMTransformer + SpladePooling)."""
    module.model.save_pretrained(folder)
    write_json_atomic(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.sparse_encoder.models.MLMTransformer"},
        {"idx": 1, "name": "1", "path": "1_SpladePooling",
         "type": "sentence_transformers.sparse_encoder.models.SpladePooling"},
    ])
    write_json_atomic(folder / "1_SpladePooling" / "config.json",
                      {"pooling_strategy": "max", "activation_function": "relu",
                       "word_embedding_dimension": module.vocab_size})
    write_json_atomic(folder / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})
    write_json_atomic(folder / "config_sentence_transformers.json",
                      {"model_type": "SparseEncoder", "similarity_fn_name": "dot", "prompts": {},
                       "default_prompt_name": None})


# -- vectors as sparse rows --------------------------------------------------------------------------

def to_csr(vectors: Sequence[np.ndarray] | np.ndarray, vocab: int) -> Any:
    """Dense vectors (N, V) (or a list of (V,) rows) as a scipy CSR matrix of float32 (zeros dropped)."""
    from scipy import sparse

    if len(vectors) == 0:
        return sparse.csr_matrix((0, vocab), dtype=np.float32)
    return sparse.csr_matrix(np.asarray(np.stack(list(vectors)), dtype=np.float32))


def top_terms(indices: np.ndarray, values: np.ndarray, tokens: Sequence[str], top_k: int = 0,
              threshold: float = 0.0) -> dict[str, float]:
    """``{token: weight}`` of a vector's non-zero entries over ``threshold``, heaviest first, the first
    ``top_k`` (0: all)."""
    keep = values > threshold
    indices, values = np.asarray(indices)[keep], np.asarray(values)[keep]
    order = np.argsort(-values, kind="stable")
    if top_k:
        order = order[:top_k]
    return {tokens[int(indices[i])]: float(values[i]) for i in order}


def exact_search(queries: Any, docs: Any, doc_ids: list[str], query_ids: list[str],
                 k: int = 100) -> dict[str, list[str]]:
    """Top-k documents by dot product of sparse vectors (CSR (Q, V) and (N, V)): query id -> doc ids, best first."""
    out = {}
    for a in range(0, len(query_ids), 256):
        scores = (queries[a : a + 256] @ docs.T).toarray()  # (q, N)
        kk = min(k, scores.shape[1])
        top = np.argpartition(-scores, kk - 1, axis=1)[:, :kk]
        for row, qid in enumerate(query_ids[a : a + 256]):
            order = top[row][np.argsort(-scores[row, top[row]], kind="stable")]
            out[qid] = [doc_ids[j] for j in order if scores[row, j] > 0]
    return out
