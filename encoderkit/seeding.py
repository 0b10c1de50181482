"""Global seeding, for the CLI entry point only (library code takes explicit generators)."""

from __future__ import annotations

import random

import numpy as np


def seed_everything(seed: int) -> None:
    import torch  # noqa: PLC0415 - light path: encoderkit.cli imports this module for `encoderkit --help`

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
