"""Vocabulary pruning: keep only the tokens a task's data produces (plus the special tokens).

The word-embedding matrix is over half of a small encoder's parameters, while one task's data uses a few thousand
tokens. The kept ids are renumbered in their old order in the tokenizer and the embedding rows. The task data
tokenises as before (WordPiece's longest match is still there, and no longer one was added); other text may fall
back to ``[UNK]`` more often.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from encoderkit.compress.measure import LeverReport, QualityFn, finish_lever, measure_folder
from encoderkit.compress.task_data import LeverData, vocabulary_texts
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir, write_json_atomic
from encoderkit.models.folder import ModelFolder
from encoderkit.models.folder_files import copy_side_files

TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")


def used_token_ids(tokenizer: Any, texts: list[Any], keep_first: int = 0) -> list[int]:
    """Sorted ids that tokenising ``texts`` (sentences or pairs) produces, plus specials and ``range(keep_first)``."""
    ids: set[int] = set(tokenizer.all_special_ids) | set(range(min(keep_first, len(tokenizer))))
    singles = [t for t in texts if not isinstance(t, (tuple, list))]
    pairs = [t for t in texts if isinstance(t, (tuple, list))]
    for i in range(0, len(singles), 1000):
        for row in tokenizer(singles[i:i + 1000], add_special_tokens=True)["input_ids"]:
            ids.update(row)
    for i in range(0, len(pairs), 1000):
        a, b = zip(*pairs[i:i + 1000])
        for row in tokenizer(list(a), list(b), add_special_tokens=True)["input_ids"]:
            ids.update(row)
    return sorted(ids)


def rewrite_tokenizer_json(data: dict[str, Any], kept: list[int]) -> dict[str, Any]:
    """A copy of a WordPiece ``tokenizer.json`` mapping with only the ``kept`` ids, renumbered 0..n-1."""
    model = data.get("model", {})
    if model.get("type") != "WordPiece":
        raise EncoderkitError(f"vocabulary pruning supports WordPiece tokenizers (BERT, MiniLM); this one is "
                              f"{model.get('type')!r}: use int8/int4 embeddings (quantize --embeddings int4) instead")
    old = {i: tok for tok, i in model["vocab"].items()}
    new_id = {o: n for n, o in enumerate(kept)}
    out = json.loads(json.dumps(data))
    out["model"]["vocab"] = {old[o]: n for n, o in enumerate(kept)}
    for tok in out.get("added_tokens", []):
        if tok["id"] not in new_id:
            raise EncoderkitError(f"added token {tok['content']!r} (id {tok['id']}) would be dropped; keep specials")
        tok["id"] = new_id[tok["id"]]
    post = out.get("post_processor") or {}
    for spec in (post.get("special_tokens") or {}).values():
        spec["ids"] = [new_id[i] for i in spec["ids"]]
    for key in ("cls", "sep"):  # BertProcessing stores [token, id] pairs
        if isinstance(post.get(key), list):
            post[key][1] = new_id[post[key][1]]
    if out.get("padding"):
        out["padding"]["pad_id"] = new_id.get(out["padding"].get("pad_id", 0), 0)
    return out


@torch.no_grad()
def shrink_embeddings(model: torch.nn.Module, kept: list[int]) -> None:
    """Keep the rows ``kept`` of the word embeddings (and of a tied decoder and any vocab-sized bias)."""
    emb = model.get_input_embeddings()
    old_v = emb.weight.shape[0]
    idx = torch.tensor(kept)
    pad = model.config.pad_token_id
    new_pad = kept.index(pad) if pad is not None and pad in kept else None
    new = torch.nn.Embedding(len(kept), emb.weight.shape[1], padding_idx=new_pad)
    new.weight.copy_(emb.weight[idx])
    model.set_input_embeddings(new)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if out is not None:
        tied = getattr(model.config, "tie_word_embeddings", True)
        out.weight = new.weight if tied else torch.nn.Parameter(out.weight[idx].clone())
        out.out_features = len(kept)
    for mod in model.modules():  # vocab-sized biases (the MLM head's output bias)
        b = getattr(mod, "bias", None)
        if isinstance(b, torch.nn.Parameter) and b.dim() == 1 and b.shape[0] == old_v:
            mod.bias = torch.nn.Parameter(b[idx].clone())
    model.config.vocab_size = len(kept)
    model.config.pad_token_id = new_pad


def prune_vocab(model_dir: str | Path, cfg: Any, out_dir: str | Path, quality_fn: QualityFn | None = None,
                data: LeverData | None = None) -> LeverReport:
    """The ``prune method=vocab`` lever: keep the tokens of ``cfg.vocab_data`` files (+ specials), each
    read by the model's task's reader; without them, those of ``data``'s calibration source."""

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    data = data or LeverData.for_model(model_dir)
    sources = list(cfg.vocab_data) or ([data.source("calib")] if data.source("calib") else [])
    if not sources:
        raise EncoderkitError(f"prune method=vocab needs --vocab-data FILE [FILE ...]: the {data.task} model's "
                              "train/dev/test data")
    tok_json = model_dir / "tokenizer.json"
    if not tok_json.is_file():
        raise EncoderkitError(f"{model_dir}: tokenizer.json is missing; vocabulary pruning rewrites a fast tokenizer")
    before = measure_folder(model_dir, latency=cfg.measure, quality_fn=quality_fn)
    folder = ModelFolder.open(model_dir)
    tokenizer = folder.tokenizer()
    texts: list[Any] = []
    for f in sources:
        texts.extend(vocabulary_texts(str(f), data.task, card=folder.card, folder=model_dir))
    kept = used_token_ids(tokenizer, texts, cfg.keep_tokens)
    model = folder.load()
    old_vocab = model.config.vocab_size
    shrink_embeddings(model, kept)
    new_json = rewrite_tokenizer_json(json.loads(tok_json.read_text(encoding="utf-8")), kept)
    inv = {i: t for t, i in new_json["model"]["vocab"].items()}
    with output_dir(out_dir, cfg.overwrite) as tmp:
        model.save_pretrained(tmp)
        copy_side_files(model_dir, tmp)
        write_json_atomic(tmp / "tokenizer.json", new_json)
        (tmp / "vocab.txt").write_text("".join(inv[i] + "\n" for i in range(len(kept))), encoding="utf-8")
        details = {"vocab_size": [old_vocab, len(kept)], "texts": len(texts)}
        report = finish_lever(tmp, "prune", "vocab", model_dir, out_dir, cfg.result_dict(), before, details,
                              latency=cfg.measure, quality_fn=quality_fn)
    return report

