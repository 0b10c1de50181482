"""Bi-encoder embeddings: ``features`` encodes and saves, ``train`` wires fine-tuning and evaluation."""
