"""Extractive question answering: ``data`` reads SQuAD, ``features`` featurises and decodes, ``train`` wires fine-tuning and evaluation. ``options`` holds its settings."""
