"""Named-entity recognition: ``data`` reads CoNLL/JSONL, ``features`` featurises and decodes, ``train`` wires fine-tuning and evaluation. ``options`` holds its settings."""
