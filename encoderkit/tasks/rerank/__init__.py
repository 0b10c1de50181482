"""Cross-encoder reranking: see ``train`` for the listwise head and its wiring."""
