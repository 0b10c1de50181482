"""Hard negatives for generated queries, mined with the model being adapted, and the MarginMSE wiring of GPL.

Candidates are the bi-encoder's top :data:`~encoderkit.tasks.embed.mining.MINE_TO` passages; one scoring within
``margin`` (cosine) or ``ce_margin`` (cross-encoder) of the positive is likely another answer, so it is skipped.
With a cross-encoder each row also carries GPL's margins ``CE(q, pos) - CE(q, neg)``, which the bi-encoder learns
by MarginMSE (:func:`margin_build`; the loss is :mod:`encoderkit.tasks.margin_mse`'s).
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
from encoderkit.models.folder import ModelFolder
from encoderkit.tasks import get_task
from encoderkit.tasks.common import load_tokenizer
from encoderkit.tasks.embed.exact import search
from encoderkit.tasks.embed.features import encode, encode_cached, load_bi_encoder
from encoderkit.tasks.embed.mining import MINE_TO
from encoderkit.tasks.margin_mse import ce_margins, margin_mse, with_margins


@dataclass
class Mined:
    rows: list[dict[str, Any]]  # {query, positive, negatives[, margins]}: finetune --task embed's JSONL
    skipped_positives: int  # candidates left out as likely positives
    topped_up: int  # random negatives added where too few mined ones were left
    dropped: int = 0  # queries left without enough scored negatives (GPL)


def doc_length(model: Path) -> int:
    """Sub-tokens per passage when ``model`` encodes the corpus (mining and evaluation alike, so they share the
    cached corpus embeddings): the folder's own length, cut to its positions."""
    return ModelFolder.open(model, weights=False, tokenizer=False).max_length


def mine(passages: list[Passage], queries: dict[str, list[str]], model: Path, *, num_negatives: int, margin: float,
         ce: tuple[Any, Any, int] | None, ce_margin: float, seed: int, max_query_length: int, batch_size: int) -> Mined:
    """Training rows for every generated query (see the module docstring)."""
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
        scored = ce_margins(ce, [q for _, q in pairs], positives, [[by_id[d].full for d in negs] for negs in picked],
                            desc="cross-encoder scores")
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


def margin_build(margins: list[list[float]], scale: float) -> Callable[..., Any]:
    """A ``build`` for ``finetune.run``: the embed task's own (its model, data, batches, saving), trained with
    :func:`~encoderkit.tasks.margin_mse.margin_mse` on ``margins`` (row i of the training file: one per negative)
    instead of in-batch negatives."""
    def build(data: Any, options: Any, tokenizer: Any, folder: Any) -> Any:
        if data.max_train_examples:
            raise EncoderkitError("MarginMSE training reads every row of its file (no --max-train-examples)")
        tr = get_task("embed").build(data, options, tokenizer, folder)
        k = min(len(m) for m in margins)
        if k == 0:
            raise EncoderkitError("GPL: no query has a scored negative (the corpus is too small, or every candidate "
                                  "was a likely positive: lower --ce-margin)")

        def loss_fn(module: Any, batch: dict[str, Any]) -> Any:
            q = module(**{a[2:]: v for a, v in batch.items() if a.startswith("q_")})
            p = module(**{a[2:]: v for a, v in batch.items() if a.startswith("p_")})
            return margin_mse(q, p, batch["margins"], options.scale), {}

        batches = with_margins(tr.source.make_batch, margins, k)
        return replace(tr, loss_fn=loss_fn, source=replace(tr.source, make_batch=batches))

    return build
