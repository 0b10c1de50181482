"""Sequence classification (single texts or pairs; multi-class or multi-label): see ``train`` for the head and its wiring."""
