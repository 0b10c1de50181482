"""The static embedding folder: one vector per token, a text's embedding the mean of its tokens' vectors. The layout
is model2vec's with the sentence-transformers modules beside it, so one folder loads in ``SentenceTransformer``,
model2vec's ``StaticModel`` and encoderkit::

    config.json              {"model_type": "model2vec", "architectures": ["StaticModel"], "hidden_dim": D, ...}
    model.safetensors        embeddings (K + 1, D) float32: one row per kept token, the last row zeros
                             mapping    (V,) int64: token id -> its row (unkept ids -> the zero row)
                             weights    (V,) float32: token id -> its frequency weight
    tokenizer.json, ...      the teacher's tokenizer, unchanged (no truncation, no padding)
    modules.json             StaticEmbedding (path ".") -> Normalize (1_Normalize)
    encoderkit.json          task embed, kind static, the distillation's settings and counts

Every reader computes the weighted table ``embeddings[mapping] * weights[:, None]`` (V, D).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from encoderkit.errors import EncoderkitError

MODEL_TYPE = "model2vec"
WEIGHTS_FILE = "model.safetensors"
ST_STATIC = "sentence_transformers.models.StaticEmbedding"
ST_NORMALIZE = "sentence_transformers.models.Normalize"
STATIC_MAX_LENGTH = 1_000_000  # tokens a static model reads of a text: all of it


def is_static_config(config: dict[str, Any]) -> bool:
    """Whether a folder's ``config.json`` describes a static embedding model (model2vec layout)."""
    return config.get("model_type") == MODEL_TYPE


def write_static_folder(folder: Path, tokenizer: Any, embeddings: np.ndarray, mapping: np.ndarray,
                        weights: np.ndarray, config: dict[str, Any]) -> None:
    """Write the files of the module docstring into ``folder`` (the card is the caller's).

    embeddings: (K + 1, D) float32, the last row zeros; mapping: (V,) int64 row of each token id;
    weights: (V,) float32; ``config``: extra model2vec config keys (``apply_pca``, ``sif_coefficient``...)."""
    folder = Path(folder)
    save_file({"embeddings": np.ascontiguousarray(embeddings, dtype=np.float32),
               "mapping": np.ascontiguousarray(mapping, dtype=np.int64),
               "weights": np.ascontiguousarray(weights, dtype=np.float32)}, str(folder / WEIGHTS_FILE))
    tokenizer.save_pretrained(folder)
    # sentence-transformers and model2vec read tokenizer.json with the `tokenizers` library: a static model
    # reads whole texts (no truncation) one at a time (no padding)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    tok.save(str(folder / "tokenizer.json"))
    # max_length: model2vec's StaticModel cuts texts at 512 tokens unless the config names its own length; a static
    # model reads whole texts here (seq_length), so both say the same
    meta = {"model_type": MODEL_TYPE, "architectures": ["StaticModel"], "hidden_dim": int(embeddings.shape[1]),
            "seq_length": STATIC_MAX_LENGTH, "max_length": STATIC_MAX_LENGTH, "normalize": True, **config}
    (folder / "config.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    modules = [{"idx": 0, "name": "0", "path": ".", "type": ST_STATIC},
               {"idx": 1, "name": "1", "path": "1_Normalize", "type": ST_NORMALIZE}]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2) + "\n", encoding="utf-8")
    (folder / "1_Normalize").mkdir(exist_ok=True)
    st_config = {"model_type": "SentenceTransformer", "similarity_fn_name": "cosine"}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config, indent=2) + "\n", encoding="utf-8")


def read_static_table(folder: Path) -> np.ndarray:
    """The weighted token table (V, D) float32 of a static folder: ``embeddings[mapping] * weights[:, None]``
    (a folder without ``mapping`` / ``weights``, as model2vec writes most, has one row per token id)."""
    path = Path(folder) / WEIGHTS_FILE
    try:
        tensors = load_file(str(path))
    except Exception as e:  # a damaged file: the message names it
        raise EncoderkitError(f"{path} could not be read as safetensors ({e}); re-create the static folder") from e
    if "embeddings" not in tensors:
        raise EncoderkitError(f"{path} holds no 'embeddings' tensor; it is not a static embedding model "
                              "(re-create it with encoderkit distill --to static)")
    table = tensors["embeddings"].astype(np.float32)
    if "mapping" in tensors:
        table = table[tensors["mapping"].astype(np.int64)]
    if "weights" in tensors:
        table = table * tensors["weights"].astype(np.float32)[:, None]
    return np.ascontiguousarray(table)


def static_parameters(folder: Path) -> int:
    """The float parameters of a static folder: its token table (K + 1, D) and per-token weights (V,), read from the
    safetensors header."""
    with safe_open(str(Path(folder) / WEIGHTS_FILE), "np") as f:
        names = set(f.keys())
        return sum(int(np.prod(f.get_slice(k).get_shape())) for k in ("embeddings", "weights") if k in names)
