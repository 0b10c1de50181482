"""Bi-encoder embeddings: pooled, L2-normalised token states (what sentence-transformers computes for
``Transformer -> Pooling -> Normalize``), trained with in-batch negatives (+ Matryoshka slices) and saved in the
sentence-transformers layout, so ``SentenceTransformer(folder)`` loads it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from encoderkit.io import cached_array, write_json_atomic
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import model_fingerprint
from encoderkit.models.pooling import AUTO, pool, st_pooling_config, task_pooling
from encoderkit.tasks.embed.embedder import Embedder


def folder_max_length(folder: Path) -> int | None:
    p = Path(folder) / "sentence_bert_config.json"
    return int(json.loads(p.read_text(encoding="utf-8")).get("max_seq_length", 0)) or None if p.is_file() else None


class BiEncoder(nn.Module):
    """An HF encoder + pooling + L2 normalisation: token ids (B, T) -> unit embeddings (B, H).
    ``normalize=False`` gives the pooled vectors as they are (embedding distillation normalises each
    Matryoshka slice itself); ``forward(..., normalize=...)`` overrides it for one call (the
    :class:`~encoderkit.tasks.embed.embedder.Embedder` pools here, on the device, and normalises itself)."""

    def __init__(self, encoder: nn.Module, pooling: str, normalize: bool = True) -> None:
        super().__init__()
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor | None = None,
                normalize: bool | None = None) -> torch.Tensor:
        kw = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state
        pooled = pool(hidden.float(), attention_mask, self.pooling)
        normalize = self.normalize if normalize is None else normalize
        return nn.functional.normalize(pooled, dim=-1) if normalize else pooled


@torch.no_grad()
def encode(model: BiEncoder | Embedder, tokenizer, texts: list[str], max_length: int, batch_size: int = 64,
           progress: bool = False) -> np.ndarray:
    """Embeddings (N, H) float32 of ``texts`` (truncated to ``max_length`` sub-tokens, ``batch_size`` texts per
    model call) by an :class:`Embedder` (its engine and normalisation), or by the module ``model`` as it is now,
    in eval mode (:meth:`Embedder.of_module`: pooled on its device; unit vectors unless ``model.normalize`` is off)."""
    if isinstance(model, Embedder):
        return model.embed(texts, max_length=max_length, progress=progress, max_batch=batch_size)
    was_training = model.training
    model.eval()
    try:
        return Embedder.of_module(model, tokenizer, max_length, batch_size).embed(texts, progress=progress)
    finally:
        if was_training:
            model.train()


def mnrl_loss(q: torch.Tensor, passages: torch.Tensor, scale: float, dims: list[int],
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H), passages (B*(1+k), H) with row i's positive at index i: in-batch-negatives
    cross-entropy, summed over the full size and each Matryoshka size in ``dims``. ``mask`` (B, B*(1+k)) bool:
    the columns left out of row i's softmax (:func:`false_negative_mask`: another copy of its positive, or a
    passage judged relevant to its query)."""
    target = torch.arange(q.shape[0], device=q.device)
    total = q.new_zeros(())
    for d in [q.shape[1]] + [d for d in dims if d < q.shape[1]]:
        qd = nn.functional.normalize(q[:, :d], dim=-1)
        pd = nn.functional.normalize(passages[:, :d], dim=-1)
        logits = scale * qd @ pd.T
        if mask is not None:
            logits = logits.masked_fill(mask.to(logits.device), torch.finfo(logits.dtype).min)
        total = total + nn.functional.cross_entropy(logits, target)
    return total


def false_negative_mask(queries: list[str], columns: list[str], relevant: dict[str, set[str]]) -> torch.Tensor:
    """(B, len(columns)) bool: True where column c is not row i's own positive (c != i) but is a text judged
    relevant to row i's query (``relevant``: query text -> its positives' texts, over the whole training set). A
    document cited by two training claims, or a claim with two cited documents, is otherwise a negative of the
    other row in the same batch: the loss then pushes a query away from its own answer (length-bucketed batches
    put the copies of one document side by side)."""
    mask = torch.zeros(len(queries), len(columns), dtype=torch.bool)
    for i, query in enumerate(queries):
        rel = relevant.get(query, set())
        for c, text in enumerate(columns):
            if c != i and text in rel:
                mask[i, c] = True
    return mask


def load_bi_encoder(folder: Path | ModelFolder, pooling: str = AUTO) -> BiEncoder:
    """The encoder of ``folder`` with ``pooling`` ('first' or 'mean'; ``auto``: the folder's own, by
    :func:`encoderkit.models.pooling.task_pooling`)."""
    mf = folder if isinstance(folder, ModelFolder) else ModelFolder.open(folder, tokenizer=False)
    return BiEncoder(mf.load(task="embed"), task_pooling(mf, "embed", pooling))


def save_sentence_transformers(model: BiEncoder, tokenizer, folder: Path, max_length: int) -> None:
    """HF AutoModel files + the sentence-transformers module files, in ``folder``."""
    model.encoder.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    hidden = model.encoder.config.hidden_size
    write_json_atomic(folder / "modules.json", [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ])
    write_json_atomic(folder / "1_Pooling" / "config.json", st_pooling_config(model.pooling, hidden))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    write_json_atomic(folder / "sentence_bert_config.json", {"max_seq_length": max_length, "do_lower_case": False})


def encode_cached(model: BiEncoder | Embedder, tokenizer, texts: list[str], max_length: int, batch_size: int,
                  progress: bool, folder: Path) -> np.ndarray:
    """:func:`encode`, with the result kept in ``$ENCODERKIT_CACHE/embeddings`` (default
    ``~/.cache/encoderkit``) under a hash of the saved model's weight files, the tokenizer, the
    pooling, ``max_length`` and the texts: evaluating a model and mining with it encode a corpus once.
    The cache holds plain ``.npy`` arrays (read without pickle)."""
    h = hashlib.sha256(json.dumps({"pooling": model.pooling, "max_length": max_length, "n": len(texts)}).encode())
    h.update(model_fingerprint(folder).encode())  # its weights, tokenizer and pooling files
    backend = getattr(tokenizer, "backend_tokenizer", None)  # the tokenizer actually used, not the folder's file
    if backend is not None:  # less the truncation/padding state that each call sets
        spec = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        h.update(json.dumps(spec, sort_keys=True).encode())
    else:
        h.update(json.dumps(tokenizer.get_vocab(), sort_keys=True).encode())
    for t in texts:
        h.update(t.encode("utf-8", "surrogatepass") + b"\0")
    return cached_array("embeddings", h.hexdigest(), len(texts),
                        lambda: encode(model, tokenizer, texts, max_length, batch_size, progress),
                        "the corpus embeddings")
