"""Cross-encoder reranking: ``data`` builds query groups, ``features`` makes and scores (query, passage) pairs, ``train`` wires listwise fine-tuning and evaluation."""
