"""A full disk during a checkpoint or output write, through the real CLI: the stage's clear message (exit 2, no
traceback), no temporary folder left, and ``--resume`` then continues."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from encoderkit.cli import main
from tests.test_finetune import _tsv
from tests.test_pretrain import SENTENCE, make_store


def _enospc(*a, **k):
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _fail_on_call(n: int, real):
    """A stand-in for ``real`` whose ``n``-th call (1-based) fails as a full disk does."""
    calls = [0]

    def f(*a, **k):
        calls[0] += 1
        return _enospc() if calls[0] == n else real(*a, **k)

    return f


def _leftovers(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if ".tmp-" in p.name)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_tokenizer_dir) -> Path:
    return make_store(tmp_path_factory.mktemp("wf"), tiny_tokenizer_dir, (SENTENCE + "\n") * 60, seq_len=33)


def _pretrain_args(store: Path, out: Path) -> list[str]:
    return ["pretrain", "--data", str(store), "--out", str(out), "--layers", "2", "--hidden", "32", "--heads", "4",
            "--ffn", "64", "--batch-size", "8", "--max-steps", "6", "--save-every", "2", "--eval-blocks", "8",
            "--bf16", "off"]


def test_full_disk_during_a_checkpoint_then_resume(store, tmp_path, monkeypatch, capsys, one_thread):
    import encoderkit.train.checkpoint as ckpt
    from encoderkit.train import pretrain

    out = tmp_path / "model"
    args = _pretrain_args(store, out)
    monkeypatch.setattr(ckpt, "save_model", _fail_on_call(2, ckpt.save_model))  # step 2 is written, step 4 is not
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error: could not write checkpoint" in err, err
    assert "No space left on device" in err and "step-0000002 is intact" in err and "--resume" in err
    checkpoints = tmp_path / "model-run" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step-0000002"] and _leftovers(tmp_path) == []
    assert not out.exists()

    monkeypatch.undo()
    losses = []
    real_loss = pretrain.mlm_loss_fn
    monkeypatch.setattr(pretrain, "mlm_loss_fn", lambda m, b: losses.append(1) or real_loss(m, b))
    assert main([*args, "--resume"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["steps"] == 6 and len(losses) == 4  # continued from step 2, did not start over
    assert (out / "model.safetensors").is_file() and _leftovers(tmp_path) == []


def test_full_disk_writing_the_output_keeps_the_checkpoints_for_resume(store, tmp_path, monkeypatch, capsys,
                                                                       one_thread):
    import transformers.modeling_utils as mu

    out = tmp_path / "model"
    args = _pretrain_args(store, out)
    monkeypatch.setattr(mu, "safe_save_file", _enospc)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"error: could not write {out} (I/O error: No space left on device" in err, err
    assert "rerun with --resume" in err
    assert not out.exists() and _leftovers(tmp_path) == []
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    assert (out / "model.safetensors").is_file()


def test_finetune_full_disk_leaves_no_hidden_run_folder_or_temporary_output(tiny_bert_dir, tmp_path, monkeypatch,
                                                                            capsys, one_thread):
    import transformers.modeling_utils as mu

    import encoderkit.train.checkpoint as ckpt

    train, dev = _tsv(tmp_path / "train.tsv", 64, 0), _tsv(tmp_path / "dev.tsv", 16, 1)
    out = tmp_path / "ft"
    args = ["finetune", "--model", str(tiny_bert_dir), "--task", "classify", "--train", str(train), "--dev", str(dev),
            "--out", str(out), "--max-steps", "4", "--batch-size", "8", "--eval-every", "2",
            "--few-label", "off"]  # the standard route's checkpoints (32 a class would take the few-label route)
    # the first checkpoint cannot be written: nothing to resume from, so no .ft.run is kept
    monkeypatch.setattr(ckpt, "save_model", _enospc)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "error: could not write checkpoint" in err and "no checkpoint was written yet" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dev.tsv", "train.tsv"]
    monkeypatch.undo()
    # training finishes but the model folder cannot be written: the checkpoints stay for --resume
    monkeypatch.setattr(mu, "safe_save_file", _enospc)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "rerun with --resume" in err and "Traceback" not in err
    assert (tmp_path / ".ft.run" / "checkpoints").is_dir() and _leftovers(tmp_path) == [] and not out.exists()
    monkeypatch.undo()
    assert main([*args, "--resume"]) == 0
    printed = json.loads(capsys.readouterr().out)  # the finished run resumed: no step ran, so no speed is made up
    assert printed["steps"] == 4 and printed["train_examples_per_s"] is None and printed["dev"]["accuracy"] >= 0
    assert (out / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dev.tsv", "ft", "train.tsv"]


# -- an unwritable --out is refused before the first step ------------------------------------------

def _count_steps(monkeypatch) -> list[int]:
    from encoderkit.train import engine

    steps: list[int] = []
    real = engine.fit
    monkeypatch.setattr(engine, "fit", lambda *a, **k: steps.append(1) or real(*a, **k))
    from encoderkit.train import finetune, pretrain

    monkeypatch.setattr(pretrain, "fit", lambda *a, **k: steps.append(1) or real(*a, **k))
    monkeypatch.setattr(finetune, "fit", lambda *a, **k: steps.append(1) or real(*a, **k), raising=False)
    return steps


def test_out_under_a_file_is_refused_before_training(store, tmp_path, monkeypatch, capsys, tiny_bert_dir, one_thread):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    started = _count_steps(monkeypatch)
    assert main(_pretrain_args(store, blocker / "sub" / "model")) == 2
    err = capsys.readouterr().err
    assert f"--out {blocker / 'sub' / 'model'} cannot be created: {blocker} is a file" in err, err
    assert main([*_pretrain_args(store, tmp_path / "ok"), "--run-dir", str(blocker / "run")]) == 2
    assert f"{blocker} is a file" in capsys.readouterr().err
    train = _tsv(tmp_path / "train.tsv", 16, 0)
    assert main(["finetune", "--model", str(tiny_bert_dir), "--task", "classify", "--train", str(train),
                 "--out", str(blocker / "ft")]) == 2
    assert "is a file" in capsys.readouterr().err
    # every stage with an --out, through the CLI (distill would otherwise load its teacher and train first)
    assert main(["distill", "--teacher", str(tiny_bert_dir), "--train", str(train), "--out", str(blocker / "d")]) == 2
    assert "is a file" in capsys.readouterr().err
    assert started == [] and sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "train.tsv"]


def read_only(parent: Path, monkeypatch) -> Path:
    """Make ``parent`` (created here) answer as a read-only file system to the write check's probe folder
    (chmod would not do: the tests may run as root)."""
    import errno
    import tempfile

    parent.mkdir()
    real = tempfile.mkdtemp

    def mkdtemp(*a, dir=None, **k):  # what a read-only file system (or a folder the user may not write) answers
        if dir is not None and Path(dir) == parent:
            raise OSError(errno.EROFS, "Read-only file system", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    return parent


def test_read_only_parent_is_refused_before_training(store, tmp_path, monkeypatch, capsys, one_thread):
    parent = read_only(tmp_path / "read-only", monkeypatch)
    started = _count_steps(monkeypatch)
    assert main([*_pretrain_args(store, parent / "model"), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert (f"--out {parent / 'model'} cannot be written: creating a folder in {parent} failed (Read-only file system)"
            in err)
    assert started == [] and list(parent.iterdir()) == [] and not (tmp_path / "run").exists()


def test_a_cache_that_cannot_be_written_is_skipped_with_a_note(tmp_path, tiny_bert_dir, monkeypatch, capsys):
    import numpy as np

    from encoderkit.tasks.common import load_tokenizer
    from encoderkit.tasks.embed import features as embed

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("ENCODERKIT_CACHE", str(blocker / "cache"))  # the cache folder cannot be created
    model, tok = embed.load_bi_encoder(tiny_bert_dir, "mean"), load_tokenizer(tiny_bert_dir)
    texts = ["the movie python", "it was fun"]
    out = embed.encode_cached(model, tok, texts, 16, 8, False, tiny_bert_dir)
    assert np.allclose(out, embed.encode(model, tok, texts, 16, 8))
    assert "could not cache the corpus embeddings" in capsys.readouterr().err
    monkeypatch.setenv("ENCODERKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(np, "save", lambda f, *a, **k: _raise_enospc())
    embed.encode_cached(model, tok, texts, 16, 8, False, tiny_bert_dir)
    assert "No space left on device" in capsys.readouterr().err
    assert list((tmp_path / "cache" / "embeddings").iterdir()) == []  # no partial file left


def _raise_enospc():
    import errno

    raise OSError(errno.ENOSPC, "No space left on device")


def test_output_dir_rewords_write_failures_only(tmp_path):
    import errno

    from encoderkit.errors import EncoderkitError
    from encoderkit.io import output_dir

    # reading a missing input beside the output is not a write failure
    with pytest.raises(FileNotFoundError), output_dir(tmp_path / "out"):
        (tmp_path / "missing-input.txt").read_text()
    quota = r"could not write .*out \(Disk quota exceeded\).* and rerun$"
    with pytest.raises(EncoderkitError, match=quota), output_dir(tmp_path / "out"):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # and no temporary folder either time


def test_open_text_atomic_renames_on_success_and_leaves_nothing_on_failure(tmp_path):
    import errno

    from encoderkit.errors import EncoderkitError
    from encoderkit.io import open_text_atomic

    out = tmp_path / "o.jsonl"
    with open_text_atomic(out) as f:
        f.write("a\n")
        assert not out.exists()  # only under its final name once the block ends
        f.write("b\n")
    assert out.read_text() == "a\nb\n" and sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
    with pytest.raises(ValueError), open_text_atomic(out) as f:
        f.write("half")
        raise ValueError("a bad record")
    assert out.read_text() == "a\nb\n" and sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]  # kept as it was
    with pytest.raises(FileNotFoundError), open_text_atomic(tmp_path / "p.jsonl"):
        (tmp_path / "missing-input.txt").read_text()  # a read error beside the output is not a write failure
    with pytest.raises(EncoderkitError, match=r"could not write .*p\.jsonl \(No space left on device\)"), \
            open_text_atomic(tmp_path / "p.jsonl"):
        raise OSError(errno.ENOSPC, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o.jsonl"]
