"""Rerank training data: groups of one query, one positive and a pool of negatives, from a triples
JSONL (``{query, positive, negatives}``) or a BEIR source (each judged (query, doc) pair is a group;
negatives ``sampled`` at random from the corpus or ``mined`` from a bi-encoder's ranks 4-30, see
:mod:`encoderkit.tasks.embed.mining`)."""

from __future__ import annotations

from typing import Any

from encoderkit.data.beir import Triple, is_beir_source, load_retrieval
from encoderkit.tasks.common import TrainData, seeded_subset
from encoderkit.tasks.embed.data import read_pairs_file, refuse_sheet_on_beir
from encoderkit.tasks.embed.mining import groups_from_beir
from encoderkit.tasks.rerank.options import RerankOptions


def train_groups(data: TrainData, options: RerankOptions, audit: dict[str, Any] | None = None) -> list[Triple]:
    """The training groups of ``data.train`` (a seeded subset of ``data.max_train_examples``; 0: all),
    each with its whole pool of negatives to draw from every epoch. A pairs file's ``--audit-sheet`` drops the pairs
    marked ``no`` first (counts into ``audit``)."""
    if is_beir_source(data.train):
        refuse_sheet_on_beir(data, options.audit_sheet)
        groups = groups_from_beir(load_retrieval(data.train), negatives=options.negatives,
                                  num_negatives=options.num_negatives, seed=data.seed, miner=options.miner,
                                  max_query_length=options.max_query_length, batch_size=data.eval_batch_size,
                                  pool=True, max_length=options.max_length)
    else:
        groups = read_pairs_file(data.train, options.audit_sheet, audit)
    return seeded_subset(groups, data.max_train_examples, data.seed)
