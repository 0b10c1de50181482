"""Hard negatives for generated queries, mined with the model being adapted, and the MarginMSE wiring of GPL.

Each query's candidates are the bi-encoder's top :data:`~encoderkit.tasks.embed.mining.MINE_TO` passages
(:func:`~encoderkit.tasks.embed.mining.candidates`, its own passage left out). A candidate that scores almost as
high as the positive is likely another answer to the query, not a negative: it is skipped when its cosine is
within ``margin`` of the positive's, or, given a cross-encoder, when the cross-encoder's score is within
``ce_margin`` of the positive's. ``num_negatives`` are drawn (seeded) from what is left, topped up with random
passages when too few remain.

GPL (Wang et al. 2022): with a cross-encoder, every (query, positive, negative) carries the cross-encoder's
margin ``CE(q, pos) - CE(q, neg)``, and the bi-encoder learns it: MarginMSE, the mean squared error between
``scale * (cos(q, pos) - cos(q, neg))`` and that margin (:func:`margin_build`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from encoderkit.adapt.passages import Passage
from encoderkit.adapt.queries import positive_text
from encoderkit.errors import EncoderkitError


@dataclass
class Mined:
    rows: list[dict[str, Any]]  # {query, positive, negatives[, margins]}: finetune --task embed's JSONL
    skipped_positives: int  # candidates left out as likely positives
    topped_up: int  # random negatives added where too few mined ones were left
    dropped: int = 0  # queries left without enough scored negatives (GPL)


def open_cross_encoder(name: str) -> tuple[Any, Any, int]:
    """(torch model, tokenizer, max length) of a rerank folder; anything else is refused."""
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks import TASKS, get_task
    from encoderkit.tasks.common import resolve_model

    folder = ModelFolder.open(resolve_model(name))
    task = get_task(folder.task) if folder.task in TASKS else None
    if task is None or task.endpoint != "rerank":
        raise EncoderkitError(f"--cross-encoder {name} is a {folder.task!r} model; GPL needs a cross-encoder "
                              "(a rerank folder: `encoderkit finetune --task rerank`, or a sentence-transformers "
                              "CrossEncoder with one output)")
    return folder.load(), folder.tokenizer(), min(folder.max_length or 256, 512)


def doc_length(model: Path) -> int:
    """Sub-tokens per passage when ``model`` encodes the corpus (mining and evaluation alike, so they share the
    cached corpus embeddings): the folder's own length, cut to its positions."""
    from encoderkit.models.folder import ModelFolder

    return ModelFolder.open(model, weights=False, tokenizer=False).max_length


def mine(passages: list[Passage], queries: dict[str, list[str]], model: Path, *, num_negatives: int, margin: float,
         ce: tuple[Any, Any, int] | None, ce_margin: float, seed: int, max_query_length: int, batch_size: int) -> Mined:
    """Training rows for every generated query (see the module docstring)."""
    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed.exact import search
    from encoderkit.tasks.embed.features import encode, encode_cached, load_bi_encoder
    from encoderkit.tasks.embed.mining import MINE_TO

    by_id = {p.id: p for p in passages}
    doc_ids = [p.id for p in passages]
    pairs = [(pid, q) for pid in queries for q in queries[pid]]
    bi, tok = load_bi_encoder(model), load_tokenizer(model)
    # the corpus embeddings are those the evaluation before training cached (same model, texts and length)
    docs = encode_cached(bi, tok, [p.full for p in passages], doc_length(model), batch_size, True, model)
    q_emb = encode(bi, tok, [q for _, q in pairs], max_query_length, batch_size, progress=True)
    del bi
    keys = [str(i) for i in range(len(pairs))]
    ranked = search(q_emb, docs, doc_ids, keys, k=min(MINE_TO + 1, len(doc_ids)))
    row = {d: i for i, d in enumerate(doc_ids)}
    rng = np.random.default_rng(seed)
    picked: list[list[str]] = []
    skipped = topped = 0
    for n, (pid, _) in enumerate(pairs):
        cands = [d for d in ranked[keys[n]] if d != pid]
        sims = docs[[row[d] for d in cands]] @ q_emb[n] if cands else np.zeros(0)
        keep = [d for d, s in zip(cands, sims, strict=True) if s < float(docs[row[pid]] @ q_emb[n]) - margin]
        skipped += len(cands) - len(keep)
        want = num_negatives * (2 if ce is not None else 1)  # the cross-encoder then drops its likely positives
        negs = [keep[int(i)] for i in sorted(rng.permutation(len(keep))[:want])]
        while len(negs) < num_negatives and len(negs) < len(doc_ids) - 1:
            d = doc_ids[int(rng.integers(len(doc_ids)))]
            if d != pid and d not in negs:
                negs.append(d)
                topped += 1
        picked.append(negs)
    positives = [positive_text(by_id[pid], q) for pid, q in pairs]
    margins: list[list[float]] = []
    if ce is not None:
        scored = _ce_margins(ce, [q for _, q in pairs], positives, [[by_id[d].full for d in negs] for negs in picked])
        for n, m in enumerate(scored):
            kept = [(d, x) for d, x in zip(picked[n], m, strict=True) if x > ce_margin]
            skipped += len(picked[n]) - len(kept)
            picked[n] = [d for d, _ in kept[:num_negatives]]
            margins.append([x for _, x in kept[:num_negatives]])
    rows, short = [], 0
    for n, (_, q) in enumerate(pairs):
        if ce is not None and len(picked[n]) < num_negatives:
            short += 1  # every row trains on the same number of scored negatives
            continue
        r: dict[str, Any] = {"query": q, "positive": positives[n], "negatives": [by_id[d].full for d in picked[n]]}
        if ce is not None:
            r["margins"] = margins[n]
        rows.append(r)
    return Mined(rows, skipped, topped, short)


def _ce_margins(ce: tuple[Any, Any, int], queries: list[str], positives: list[str], negatives: list[list[str]]
                ) -> list[list[float]]:
    """``CE(q, pos) - CE(q, neg)`` per negative of each query, every pair scored in one batched pass."""
    import torch

    from encoderkit.tasks.rerank.features import score_pairs

    model, tok, max_length = ce
    qs, ps, spans = [], [], []
    for q, pos, negs in zip(queries, positives, negatives, strict=True):
        spans.append((len(ps), len(negs)))
        qs += [q] * (1 + len(negs))
        ps += [pos, *negs]
    with torch.inference_mode():
        scores = score_pairs(model, tok, qs, ps, max_length)
    return [[float(scores[a] - scores[a + 1 + j]) for j in range(n)] for a, n in spans]


def margin_mse(q: Any, passages: Any, margins: Any, scale: float) -> Any:
    """q (B, H) and passages (B + B*k, H) unit vectors (row i's positive at i, then row i's k negatives at
    B + i*k ...), margins (B, k): mean of (scale * (cos(q, pos) - cos(q, neg)) - margin)^2."""
    import torch

    b, k = margins.shape
    pos = passages[:b]  # (B, H)
    neg = passages[b:].view(b, k, -1)  # (B, k, H)
    student = scale * ((q * pos).sum(-1, keepdim=True) - torch.einsum("bh,bkh->bk", q, neg))  # (B, k)
    return torch.nn.functional.mse_loss(student, margins.to(student.dtype))


def margin_build(margins: list[list[float]], scale: float) -> Callable[..., Any]:
    """A ``build`` for ``finetune.run``: the embed task's own (its model, data, batches, saving), trained with
    :func:`margin_mse` on ``margins`` (row i of the training file: one per negative) instead of in-batch
    negatives."""
    import torch

    from encoderkit.tasks import get_task

    def build(data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        if data.max_train_examples:
            raise EncoderkitError("MarginMSE training reads every row of its file (no --max-train-examples)")
        tr = get_task("embed").build(data, options, tokenizer, folder)
        k = min(len(m) for m in margins)
        if k == 0:
            raise EncoderkitError("GPL: no query has a scored negative (the corpus is too small, or every candidate "
                                  "was a likely positive: lower --ce-margin)")
        own = tr.source.make_batch

        def make_batch(idx: np.ndarray, epoch: int) -> dict[str, Any]:
            return {**own(idx, epoch), "margins": torch.tensor([margins[int(i)][:k] for i in idx], dtype=torch.float32)}

        def loss_fn(module: Any, batch: dict[str, Any]) -> Any:
            q = module(**{a[2:]: v for a, v in batch.items() if a.startswith("q_")})
            p = module(**{a[2:]: v for a, v in batch.items() if a.startswith("p_")})
            return margin_mse(q, p, batch["margins"], options.scale), {}

        return replace(tr, loss_fn=loss_fn, source=replace(tr.source, make_batch=make_batch))

    return build
