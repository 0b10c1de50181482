"""Bi-encoder embeddings: ``data`` builds (query, positive, negatives) groups, ``features`` encodes and saves, ``train`` wires fine-tuning and evaluation."""
