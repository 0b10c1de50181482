"""``finetune --task sparse --cross-encoder``: SPLADE distilled from a cross-encoder's margins (MarginMSE on sparse
dot products, plus the FLOPS regulariser), on tiny in-process models: the loss target is the cross-encoder's
``CE(q, pos) - CE(q, neg)``, training moves the sparse margins toward a cross-encoder whose scores the test sets,
the card names the cross-encoder, and the refusals (no hard negatives, a folder that is not a reranker, a task
that cannot take the flag)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import WORDS
from deploy_models import make_task_model, tiny_root

from encoderkit.errors import EncoderkitError

K = 2  # hard negatives per row


def _rows(n: int = 32, seed: int = 0) -> list[dict]:
    """Rows whose positive shares 1-3 of the query's 3 words and whose negatives share 0-2 of them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        ws = rng.sample(WORDS, 20)
        q = ws[:3]
        rows.append({"query": " ".join(q), "positive": " ".join(q[: rng.randint(1, 3)] + ws[3:8]),
                     "negatives": [" ".join(q[: rng.randint(0, 2)] + rng.sample(ws[8:], 5)) for _ in range(K)]})
    return rows


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def rerank_dir(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "rerank")


class OverlapCE(torch.nn.Module):
    """A cross-encoder whose score is known: the number of the query's words found in the passage."""

    def __init__(self, tok) -> None:
        super().__init__()
        self.special = torch.tensor(tok.all_special_ids)
        self.unused = torch.nn.Parameter(torch.zeros(1))  # engines read the device off a parameter

    def forward(self, input_ids, attention_mask, token_type_ids, **kw):
        real = attention_mask.bool() & ~torch.isin(input_ids, self.special)
        q, p = real & (token_type_ids == 0), real & (token_type_ids == 1)
        hit = (input_ids[:, :, None] == input_ids[:, None, :]) & q[:, :, None] & p[:, None, :]  # (B, T, T)
        return SimpleNamespace(logits=hit.any(2).sum(1, keepdim=True).float())  # (B, 1)


def _cfg(model: Path, train: Path, out: Path, **kw):
    from encoderkit.train.finetune import FinetuneConfig

    settings = {"task": "sparse", "model": str(model), "train": str(train), "out": str(out), "epochs": 4,
                "batch_size": 8, "lr": 1e-3, "max_length": 32, "max_query_length": 16, "bf16": False,
                "negatives": "mined", "num_negatives": K, **kw}
    return FinetuneConfig(**settings)


def test_the_loss_target_is_the_cross_encoders_margins(tmp_path, tiny_mlm_dir, rerank_dir):
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.rerank.features import score_pairs
    from encoderkit.tasks.sparse.features import OUTPUT, flops
    from encoderkit.train.finetune import task_inputs

    rows = _rows(16)
    cfg = _cfg(tiny_mlm_dir, _jsonl(tmp_path / "t.jsonl", rows), tmp_path / "out", cross_encoder=str(rerank_dir))
    folder = ModelFolder.open(tiny_mlm_dir)
    task, data, options = task_inputs(cfg, folder)
    tr = task.build(data, options, folder.tokenizer(), folder)
    batch = tr.source.make_batch(np.arange(8), 0)
    # the rerank folder's own scores, recomputed pair by pair
    ce = ModelFolder.open(rerank_dir)
    model, tok = ce.load(), ce.tokenizer()
    want = []
    for r in rows[:8]:
        s = score_pairs(model, tok, r["query"], [r["positive"], *r["negatives"]], 256)
        want.append([s[0] - s[1 + j] for j in range(K)])
    np.testing.assert_allclose(batch["margins"].numpy(), want, atol=1e-5)
    # the loss is MarginMSE on sparse dot products against them, plus FLOPS
    module = tr.module.eval()
    with torch.no_grad():
        q = module(**{a[2:]: b for a, b in batch.items() if a.startswith("q_")})[OUTPUT]
        d = module(**{a[2:]: b for a, b in batch.items() if a.startswith("p_")})[OUTPUT]
        loss, logs = tr.loss_fn(module, batch)
    student = (q * d[:8]).sum(-1, keepdim=True) - torch.einsum("bv,bkv->bk", q, d[8:].view(8, K, -1))
    mse = float(((student - torch.tensor(want)) ** 2).mean())
    assert logs["margin_mse"] == pytest.approx(mse, rel=1e-4) and "ce" not in logs
    lam = logs["flops_factor"]
    assert float(loss) == pytest.approx(
        mse + lam * (options.flops_query * float(flops(q)) + options.flops_doc * float(flops(d))), rel=1e-4)


def _sparse_margins(folder: Path, rows: list[dict]) -> np.ndarray:
    """q.pos - q.neg of every row's negatives by the SPLADE folder (N, K)."""
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.inference import ModuleEngine
    from encoderkit.tasks.sparse.features import OUTPUT
    from encoderkit.tasks.sparse.train import encode, load_splade

    f = ModelFolder.open(folder)
    module, tok = load_splade(f), f.tokenizer()
    engine, vocab = ModuleEngine(module, [OUTPUT]), module.vocab_size

    def vec(texts: list[str], length: int) -> np.ndarray:
        return encode(engine, tok, texts, length, 32, vocab).toarray()

    q = vec([r["query"] for r in rows], 16)
    p = vec([r["positive"] for r in rows], 32)
    n = vec([x for r in rows for x in r["negatives"]], 32).reshape(len(rows), K, -1)
    return (q * p).sum(1)[:, None] - np.einsum("nv,nkv->nk", q, n)


def test_distillation_moves_the_sparse_margins_toward_the_cross_encoders(tmp_path, tiny_mlm_dir, monkeypatch):
    from safetensors.torch import load_file

    import encoderkit.tasks.sparse.train as sparse_train
    from encoderkit.models.folder import ModelFolder
    from encoderkit.tasks.margin_mse import ce_margins
    from encoderkit.train.finetune import run

    rows = _rows()
    train = _jsonl(tmp_path / "t.jsonl", rows)
    tok = ModelFolder.open(tiny_mlm_dir).tokenizer()
    ce = (OverlapCE(tok), tok, 64)
    target = np.asarray(ce_margins(ce, [r["query"] for r in rows], [r["positive"] for r in rows],
                                   [r["negatives"] for r in rows]))
    assert target.std() > 0.5  # margins of -2 .. 3 words
    opened = []
    monkeypatch.setattr(sparse_train, "open_cross_encoder", lambda name, purpose: opened.append(name) or ce)
    mse = lambda m: float(((m - target) ** 2).mean())
    before = mse(_sparse_margins(tiny_mlm_dir, rows))

    run(_cfg(tiny_mlm_dir, train, tmp_path / "distilled", cross_encoder="overlap-ce"))
    run(_cfg(tiny_mlm_dir, train, tmp_path / "contrastive"))
    assert opened == ["overlap-ce"]  # once, by the distilled run only
    distilled, contrastive = (mse(_sparse_margins(tmp_path / n, rows)) for n in ("distilled", "contrastive"))
    assert distilled < 0.5 * before and distilled < 0.5 * contrastive
    w0, w1 = load_file(tiny_mlm_dir / "model.safetensors"), load_file(tmp_path / "distilled" / "model.safetensors")
    assert any(not torch.equal(w0[n], w1[n]) for n in w0 if n in w1)
    card = json.loads((tmp_path / "distilled" / "encoderkit.json").read_text())
    assert (card["distilled_from"]["loss"] == "margin_mse"
            and card["distilled_from"]["cross_encoder"].endswith("overlap-ce"))
    assert card["config"]["cross_encoder"] == "overlap-ce"
    log = [json.loads(x) for x in (tmp_path / "distilled" / "metrics.jsonl").read_text().splitlines()]
    assert any("margin_mse" in x for x in log)
    assert "distilled_from" not in json.loads((tmp_path / "contrastive" / "encoderkit.json").read_text())


def test_refusals(tmp_path, tiny_mlm_dir, rerank_dir, tiny_tokenizer_dir):
    from encoderkit.train.finetune import run

    with_negs = _jsonl(tmp_path / "t.jsonl", _rows(16))
    bare = _jsonl(tmp_path / "bare.jsonl", [{"query": r["query"], "positive": r["positive"]} for r in _rows(16)])
    for train, kw in ((bare, {}), (with_negs, {"negatives": "sampled"})):
        with pytest.raises(EncoderkitError, match=r"--cross-encoder: .* no hard negatives .*--negatives mined"):
            run(_cfg(tiny_mlm_dir, train, tmp_path / "o1", cross_encoder=str(rerank_dir), **kw))
    embed = make_task_model(tiny_root_of(tmp_path), tiny_tokenizer_dir, "embed")
    for not_ce, what in ((embed, "'embed'"), (tiny_mlm_dir, "'mlm'")):
        with pytest.raises(EncoderkitError, match=f"--cross-encoder .* is a {what} model; sparse distillation needs a "
                                                  "cross-encoder \\(a rerank folder"):
            run(_cfg(tiny_mlm_dir, with_negs, tmp_path / "o2", cross_encoder=str(not_ce)))
    with pytest.raises(EncoderkitError, match="--task embed does not train from a cross-encoder"):
        run(_cfg(embed, with_negs, tmp_path / "o3", task="embed", cross_encoder=str(rerank_dir)))
    assert not any((tmp_path / o).exists() for o in ("o1", "o2", "o3"))


def tiny_root_of(tmp_path: Path) -> Path:
    root = tmp_path / "models"
    root.mkdir(exist_ok=True)
    return root
