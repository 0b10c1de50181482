"""SPLADE fine-tuning and evaluation on the embed task's data: in-batch contrastive, or MarginMSE on a
cross-encoder's margins (``--cross-encoder``, scored once before training; needs hard negatives), plus the FLOPS
regulariser; evaluated by exact sparse retrieval over a BEIR corpus.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from encoderkit.data.beir import is_beir_source, load_retrieval
from encoderkit.errors import EncoderkitError
from encoderkit.metrics.ranking import retrieval_scores
from encoderkit.models.folder import ModelFolder
from encoderkit.progress import note, progress
from encoderkit.tasks.batching import encode_batch
from encoderkit.tasks.common import EvalData, TaskRun, TrainData, resolve_model, seeded_subset
from encoderkit.tasks.embed.data import train_groups
from encoderkit.tasks.embed.embedder import tokenize
from encoderkit.tasks.embed.options import EmbedOptions
from encoderkit.tasks.embed.train import pair_batches
from encoderkit.tasks.inference import ModuleEngine, run_rows
from encoderkit.tasks.margin_mse import ce_margins, open_cross_encoder, with_margins
from encoderkit.tasks.sparse.features import (
    FRESH_TERMS,
    OUTPUT,
    Splade,
    check_vocabulary,
    exact_search,
    has_mlm_head,
    load_mlm,
    save_sparse_encoder,
    splade_loss,
    start_sparse,
    to_csr,
    warmup_factor,
)
from encoderkit.tasks.sparse.options import SparseOptions

OPTIONS = SparseOptions
FRESH_SAMPLE = 32  # training documents a fresh head's threshold is set on
ENCODE_CHUNK = 256  # texts per engine pass before their vectors become sparse rows (bounds the dense (N, V) block)


def encode(engine: Any, tokenizer: Any, texts: list[str], max_length: int, batch_size: int, vocab: int,
           desc: str = "") -> Any:
    """SPLADE vectors of ``texts`` as a CSR matrix (N, V) float32, by an engine whose one output is the pooled
    vector (the task's graph, or :class:`Splade` in a ModuleEngine); ``ENCODE_CHUNK`` texts at a time."""
    from scipy import sparse


    parts = []
    bar = progress(total=len(texts), desc=desc, unit="text") if desc else None
    for a in range(0, len(texts), ENCODE_CHUNK):
        rows = tokenize(tokenizer, texts[a : a + ENCODE_CHUNK], max_length)
        out = run_rows(engine, rows, tokenizer.pad_token_id or 0, batch_size)
        parts.append(to_csr([o[0] for o in out], vocab))
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.close()
    return sparse.vstack(parts).tocsr() if parts else to_csr([], vocab)


def retrieve(engine: Any, tokenizer: Any, data: Any, max_length: int, max_query_length: int, batch_size: int,
             vocab: int, k: int = 100, progress: bool = False) -> dict[str, list[str]]:
    """Top-k documents of every judged query of a BEIR :class:`~encoderkit.data.beir.Retrieval` (exact sparse
    search)."""
    doc_ids = list(data.corpus)
    docs = encode(engine, tokenizer, [data.doc_text(d) for d in doc_ids], max_length, batch_size, vocab,
                  "encode corpus" if progress else "")
    qids = list(data.qrels)
    queries = encode(engine, tokenizer, [data.queries[q] for q in qids], max_query_length, batch_size, vocab)
    return exact_search(queries, docs, doc_ids, qids, k)


def _module_engine(module: Splade) -> ModuleEngine:
    return ModuleEngine(module, [OUTPUT])


def build(data: TrainData, options: SparseOptions, tokenizer, folder: ModelFolder) -> TaskRun:
    """Read the pairs (the embed task's reader), make the SPLADE module over the folder's MLM head (or one from
    its tied word embeddings) and the loss (with ``options.cross_encoder``: MarginMSE on its margins)."""
    ce = open_cross_encoder(options.cross_encoder, "sparse distillation") if options.cross_encoder else None
    groups, k = train_groups(data, EmbedOptions(max_length=options.max_length,
                                                max_query_length=options.max_query_length,
                                                negatives=options.negatives, num_negatives=options.num_negatives,
                                                miner=options.miner))
    if not groups:
        raise EncoderkitError(f"{data.train}: no (query, positive) pairs to train on; {SPARSE_DATA}")
    if len(groups) < data.batch_size:
        raise EncoderkitError(f"{data.train}: {len(groups)} training pairs, fewer than one batch ({data.batch_size}); "
                              "lower --batch-size")
    margins = None
    if ce is not None:
        if k == 0:
            raise EncoderkitError(f"--cross-encoder: {data.train} gives no hard negatives for the cross-encoder to "
                                  "score; add --negatives mined (a BEIR source: mined by --miner; a JSONL file: "
                                  "each row's \"negatives\" list, which every row then needs)")
        margins = ce_margins(ce, [g.query for g in groups], [g.positive for g in groups],
                             [g.negatives[:k] for g in groups], desc="cross-encoder scores")
        del ce
    mlm, head = load_mlm(folder)
    check_vocabulary(tokenizer, mlm, folder.path)
    model = Splade(mlm)
    model.train()
    q_rows = tokenize(tokenizer, [g.query for g in groups], options.max_query_length)
    p_rows = tokenize(tokenizer, [g.positive for g in groups], options.max_length)
    if not has_mlm_head(folder):  # a fresh head: its threshold set on a few training documents (start_sparse)
        sample = seeded_subset(list(range(len(p_rows))), FRESH_SAMPLE, data.seed)
        t = start_sparse(model, encode_batch([p_rows[i] for i in sample], tokenizer.pad_token_id),
                         tokenizer.all_special_ids)
        head += f", output bias -{t:.3g} (about {FRESH_TERMS} terms per training document at the start)"
    note(f"sparse head: {head}")
    n_rows = [tokenize(tokenizer, g.negatives[:k], options.max_length) if k else [] for g in groups]
    pad_id = tokenizer.pad_token_id

    source = pair_batches(q_rows, p_rows, n_rows, pad_id, data)
    if margins is not None:
        source = replace(source, make_batch=with_margins(source.make_batch, margins, k))
    warmup = options.flops_warmup or len(source)

    def loss_fn(module, batch):
        inner = getattr(module, "module", module)  # DDP
        with torch.no_grad():
            inner.flops_step += 1
        factor = warmup_factor(int(inner.flops_step), warmup)
        q = module(**{a[2:]: b for a, b in batch.items() if a.startswith("q_")})[OUTPUT]
        d = module(**{a[2:]: b for a, b in batch.items() if a.startswith("p_")})[OUTPUT]
        loss, logs = splade_loss(q, d, factor * options.flops_query, factor * options.flops_doc, batch.get("margins"))
        return loss, {**logs, "flops_factor": factor}

    evaluate = None
    if data.dev:
        if not is_beir_source(data.dev):
            raise EncoderkitError(f"--dev {data.dev}: sparse evaluation needs a BEIR source (folder or SciFact zip, "
                                  "with #split)")
        dev = load_retrieval(data.dev)

        def evaluate(module: Splade) -> dict[str, float]:
            was = module.training
            module.eval()
            try:
                ranked = retrieve(_module_engine(module), tokenizer, dev, options.max_length, options.max_query_length,
                                  data.eval_batch_size, module.vocab_size)
                return retrieval_scores(ranked, dev.qrels)
            finally:
                module.train(was)

    def save(module: Splade, out: Path) -> None:
        save_sparse_encoder(module, out, options.max_length)

    card = {"task": "sparse", "max_length": options.max_length, "max_query_length": options.max_query_length,
            "head": head, "similarity": "dot", "flops_query": options.flops_query, "flops_doc": options.flops_doc,
            "flops_warmup": warmup, "hf_compatible": True}
    if margins is not None:
        card["distilled_from"] = {"cross_encoder": str(resolve_model(options.cross_encoder).resolve()),
                                  "loss": "margin_mse", "negatives_per_query": k}
    return TaskRun(model, loss_fn, source, evaluate, (data.metric or "ndcg@10", "max"), save, card,
                   num_train=len(groups))


SPARSE_DATA = ("give a JSONL of {\"query\", \"positive\", \"negatives\"?} lines or a BEIR source with #split "
               "(the embed task's training data)")


def load_splade(folder: ModelFolder) -> Splade:
    """A saved sparse folder (or any MLM-able one) as an eval-mode :class:`Splade`."""
    mlm, _ = load_mlm(folder)
    return Splade(mlm).eval()


def evaluate_folder(folder: ModelFolder, tokenizer, data: EvalData, options: SparseOptions,
                    engine: Any = None) -> dict[str, float]:
    """nDCG@10 / MRR@10 / recall@100 of exact sparse search over a BEIR corpus; ``engine`` (default: the folder's
    torch model) gives the pooled vectors."""
    if not is_beir_source(str(data.data)):
        raise EncoderkitError(f"--data {data.data}: sparse evaluation needs a BEIR source (folder or SciFact zip, "
                              "with #split)")
    vocab = int(folder.config.get("vocab_size") or len(tokenizer))
    engine = engine if engine is not None else _module_engine(load_splade(folder))
    ds = load_retrieval(str(data.data))
    if data.max_examples:  # a seeded subset of the judged queries; the whole corpus stays searchable
        keep = set(seeded_subset(sorted(ds.qrels), data.max_examples, data.seed))
        ds.qrels = {q: r for q, r in ds.qrels.items() if q in keep}
    ranked = retrieve(engine, tokenizer, ds, options.max_length, options.max_query_length, data.batch_size, vocab,
                      progress=True)
    return {**retrieval_scores(ranked, ds.qrels), "queries": len(ds.qrels), "documents": len(ds.corpus)}
