"""Embed training data: (query, positive, negatives) groups from a triples JSONL or a BEIR source
(each judged (query, doc) pair is a group; hard negatives only with ``--negatives mined``, see
:mod:`encoderkit.tasks.embed.mining`; ``sampled`` relies on the in-batch negatives alone)."""

from __future__ import annotations

from typing import Any

from encoderkit.data.beir import Triple, is_beir_source, load_retrieval, read_triples
from encoderkit.errors import EncoderkitError
from encoderkit.tasks.common import TrainData, seeded_subset
from encoderkit.tasks.embed.mining import groups_from_beir
from encoderkit.tasks.embed.options import EmbedOptions
from encoderkit.tasks.labeled import audited_pairs


def read_pairs_file(path: str, sheet: str, audit: dict[str, Any] | None) -> list[Triple]:
    """The groups of a triples JSONL, less the pairs a reviewed ``--audit-sheet`` marks ``no``
    (:func:`~encoderkit.tasks.labeled.audited_pairs`; its counts into ``audit``)."""
    groups, counts = audited_pairs(read_triples(path), path, sheet)
    if audit is not None:
        audit.update(counts)
    return groups


def refuse_sheet_on_beir(data: TrainData, sheet: str) -> None:
    if sheet:
        raise EncoderkitError(f"--audit-sheet: {data.train} is a BEIR source, whose judgements are not labeller "
                              "output; the sheet applies to a pairs file from `encoderkit label --task embed|rerank`: "
                              "drop it")


def train_groups(data: TrainData, options: EmbedOptions,
                 audit: dict[str, Any] | None = None) -> tuple[list[Triple], int]:
    """The training groups of ``data.train`` (a seeded subset of ``data.max_train_examples``; 0: all)
    and the number of hard negatives each contributes to a batch (0 unless ``mined``; for JSONL, the
    fewest any row has). A pairs file's ``--audit-sheet`` drops the pairs marked ``no`` first (counts into
    ``audit``)."""
    mined = options.negatives == "mined"
    if is_beir_source(data.train):
        refuse_sheet_on_beir(data, options.audit_sheet)
        k = options.num_negatives if mined else 0
        # sampled: in-batch negatives only (random extra negatives add little to MNRL)
        groups = groups_from_beir(load_retrieval(data.train), negatives=options.negatives, num_negatives=k,
                                  seed=data.seed, miner=options.miner, max_query_length=options.max_query_length,
                                  batch_size=data.eval_batch_size, max_length=options.max_length)
    else:
        groups = read_pairs_file(data.train, options.audit_sheet, audit)
        k = min((len(g.negatives) for g in groups), default=0) if mined else 0
    return seeded_subset(groups, data.max_train_examples, data.seed), k
