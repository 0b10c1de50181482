"""Inputs a user can give, good and bad, through every stage's reader path: one line reader (only \\n ends a record),
no traceback for any bad input (exit 2, one message naming the file), outputs never written over inputs, a corpus
confined to its folder, and temporaries of a killed run removed by the next run."""

from __future__ import annotations

import builtins
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit.cli import main
from encoderkit.errors import EncoderkitError
from encoderkit.io import BlankLines, check_input, read_lines, records, sweep_stale, write_text_atomic

ODD_BREAKS = "\u2028\u2029\x0c\x85\x1c\x1d\x1e\r"  # what str.splitlines also splits at (and a lone \r)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer_dir):
    root = tiny_root(tmp_path_factory)
    return {t: make_task_model(root, tiny_tokenizer_dir, t) for t in ("classify", "embed")}


@pytest.fixture(scope="module")
def index_dir(models, tmp_path_factory):
    d = tmp_path_factory.mktemp("faults_index")
    corpus = d / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} about movies"}) + "\n"
                              for i in range(6)))
    assert main(["index", "--model", str(models["embed"]), "--corpus", str(corpus), "--out", str(d / "idx"),
                 "--backend", "torch-fp32"]) == 0
    return d / "idx"


# -- one line reader -------------------------------------------------------------------------------
def test_only_newline_ends_a_record_and_a_bom_is_dropped(tmp_path):
    p = tmp_path / "a.txt"
    texts = [f"text {i} with {c!r} inside{c}here" for i, c in enumerate(ODD_BREAKS)]
    p.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(texts).encode() + b"\n")
    assert [t for _, t in read_lines(p)] == texts  # BOM gone, \r\n removed, every odd break kept as text
    p.write_bytes(b"a\n\n  \nb\n")
    blank = BlankLines()
    assert list(records(read_lines(p), str(p), blank)) == [(1, "a"), (4, "b")] and (blank.count, blank.first) == (2, 2)


def test_predict_gives_one_row_per_line_each_naming_its_line(models, tmp_path, capsys):
    src, out = tmp_path / "in.txt", tmp_path / "out.jsonl"
    texts = [f"good movie {c} number {i}" for i, c in enumerate(ODD_BREAKS)]
    src.write_text("\n".join(texts[:3]) + "\n\n" + "\n".join(texts[3:]) + "\n", encoding="utf-8")
    assert main(["predict", "--model", str(models["classify"]), "--input", str(src), "--output", str(out)]) == 0
    rows = [json.loads(x) for x in out.read_text(encoding="utf-8").split("\n") if x]
    assert len(rows) == len(texts)  # 8 texts, not the 16 pieces str.splitlines makes
    assert [r["line"] for r in rows] == [1, 2, 3, 5, 6, 7, 8, 9, 10][:len(texts)]  # the blank line 4 is skipped
    captured = capsys.readouterr()
    assert json.loads(captured.out)["blank_lines"] == 1 and "skipped 1 blank line" in captured.err


def test_a_raw_u2028_in_jsonl_is_valid_for_predict_search_label_and_finetune_readers(models, index_dir, tmp_path):
    from encoderkit.label.records import read_texts
    from encoderkit.tasks.tabular import read_rows

    line = json.dumps({"id": "q1", "query": "movie\u2028story", "text": "a\u2028b\u2029c", "label": "x"},
                      ensure_ascii=False)
    assert "\u2028" in line
    src = tmp_path / "q.jsonl"
    src.write_text(line + "\n" + line.replace("q1", "q2") + "\n", encoding="utf-8")
    assert main(["predict", "--model", str(models["classify"]), "--input", str(src), "--output",
                 str(tmp_path / "p.jsonl")]) == 0
    assert len((tmp_path / "p.jsonl").read_text(encoding="utf-8").split("\n")) == 3  # two rows and the last \n
    assert main(["search", "--index", str(index_dir), "--queries", str(src), "--output",
                 str(tmp_path / "s.jsonl")]) == 0
    assert [json.loads(x)["id"] for x in (tmp_path / "s.jsonl").read_text().split("\n") if x] == ["q1", "q2"]
    assert [r.fields["text"] for r in read_rows(src)] == ["a\u2028b\u2029c"] * 2
    assert read_texts(src, "text")[0] == ["a\u2028b\u2029c"] * 2


def test_a_sheet_saved_by_excel_with_a_bom_is_read(tmp_path):
    from encoderkit.label.sheet import read_sheet

    p = tmp_path / "s.csv"
    p.write_bytes(b"\xef\xbb\xbfrow,text,label,confidence,suspicion,suspect,gold\r\n0,\"two\nlines\",a,0.9,,,b\r\n")
    assert read_sheet(p) == [{"row": "0", "text": "two\nlines", "label": "a", "confidence": "0.9", "suspicion": "",
                              "suspect": "", "gold": "b"}]


# -- no traceback for any input ------------------------------------------------------------------
GOOD_JSONL = "".join(json.dumps({"id": i, "text": f"a fine movie {i}", "query": f"movie {i}", "label": "ab"[i % 2]})
                     + "\n" for i in range(6))


def _bad_files(d: Path, ext: str) -> dict[str, Path]:
    """One bad input of each kind (with suffix ``ext``): the fuzz corpus."""
    good = GOOD_JSONL.encode()
    contents = {"empty": b"", "binary": bytes(range(256)) * 8, "utf8-start": b"\xff" + good,
                "utf8-middle": good[:100] + b"\xc3\x28" + good[100:], "utf8-end": good + b"\xfe\n",
                "wrong-type": good + json.dumps({"id": 9, "text": 123, "query": 4, "label": 5}).encode() + b"\n",
                "not-json": good + b"{not json\n", "unreadable": good}
    out = {}
    for name, data in contents.items():
        (d / f"{name}{ext}").write_bytes(data)
        out[name] = d / f"{name}{ext}"
    (d / f"folder{ext}").mkdir()
    out["folder"] = d / f"folder{ext}"
    out["null-device"] = Path(os.devnull)
    out["missing"] = d / f"missing{ext}"
    os.mkfifo(d / f"pipe{ext}")
    out["pipe"] = d / f"pipe{ext}"
    return out


def _deny(monkeypatch, path: Path) -> None:
    """Reading ``path`` fails with EACCES (the tests run as root, which chmod does not stop)."""
    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open
    target = os.path.realpath(path)

    def guard(opener):
        def wrapped(file, *a, **kw):
            if isinstance(file, (str, Path)) and os.path.realpath(file) == target:
                raise PermissionError(13, "Permission denied", str(file))
            return opener(file, *a, **kw)
        return wrapped

    monkeypatch.setattr(builtins, "open", guard(real_open))
    monkeypatch.setattr(io, "open", guard(real_io_open))
    monkeypatch.setattr(os, "open", guard(real_os_open))


def _stages(models, index_dir, out: Path) -> dict[str, tuple[str, callable]]:
    """stage -> (input suffix, args(bad file)); each run writes under ``out``."""
    m, e = str(models["classify"]), str(models["embed"])
    return {
        "predict": (".jsonl", lambda f: ["predict", "--model", m, "--input", str(f), "--output", str(out / "p.jsonl")]),
        "finetune": (".jsonl", lambda f: ["finetune", "--task", "classify", "--model", m, "--train", str(f), "--out",
                                          str(out / "ft"), "--max-steps", "1", "--batch-size", "2"]),
        "index": (".jsonl", lambda f: ["index", "--model", e, "--corpus", str(f), "--out", str(out / "idx"),
                                       "--backend", "torch-fp32"]),
        "search": (".jsonl", lambda f: ["search", "--index", str(index_dir), "--queries", str(f), "--output",
                                        str(out / "s.jsonl")]),
        "label-txt": (".txt", lambda f: ["label", "--labeller", "embed", "--model", e, "--labels", "a,b", "--input",
                                         str(f), "--output", str(out / "l.jsonl")]),
        "label": (".jsonl", lambda f: ["label", "--labeller", "embed", "--model", e, "--labels", "a,b", "--input",
                                       str(f), "--output", str(out / "l.jsonl")]),
        "audit-sample": (".jsonl", lambda f: ["audit", "sample", "--input", str(f), "--output", str(out / "s.csv")]),
        "audit-review": (".csv", lambda f: ["audit", "review", "--sheet", str(f)]),
        "evaluate": (".jsonl", lambda f: ["evaluate", "--model", m, "--data", str(f)]),
    }


# a JSONL corpus line that is not UTF-8 is skipped, named and counted by `index` (docs/search.md), not refused
ACCEPTED = {("index", "utf8-start"), ("index", "utf8-middle"), ("index", "utf8-end")}


@pytest.mark.parametrize("stage", ["predict", "finetune", "index", "search", "label-txt", "label", "audit-sample",
                                   "audit-review", "evaluate"])
def test_every_stage_answers_every_bad_input_with_one_message(stage, models, index_dir, tmp_path, monkeypatch,
                                                               capsys):
    out = tmp_path / "out"
    out.mkdir()
    ext, args = _stages(models, index_dir, out)[stage]
    (tmp_path / "in").mkdir()
    bad = _bad_files(tmp_path / "in", ext)
    before = sorted(p.name for p in (tmp_path / "in").iterdir())
    for kind, f in bad.items():
        if (stage, kind) in ACCEPTED or (ext in (".txt", ".csv") and kind in ("wrong-type", "not-json")):
            continue
        with monkeypatch.context() as mp:
            if kind == "unreadable":
                _deny(mp, f)
            try:
                code = main(args(f))
            except SystemExit as e:  # argparse
                code = e.code
        err = capsys.readouterr().err
        assert code == 2, (stage, kind, code, err[-2000:])
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in err, (stage, kind, err[-2000:])
        assert str(f) in lines[0] or f.name in lines[0], (stage, kind, lines[0])  # names the file
        what = {"unreadable": "permission denied", "folder": "folder", "null-device": "device", "pipe": "pipe",
                "missing": "does not exist"}.get(kind)
        assert what is None or what in lines[0], (stage, kind, lines[0])
        assert "damaged" not in lines[0] and "free disk space" not in lines[0].lower(), (stage, kind, lines[0])
        assert list(out.iterdir()) == [], (stage, kind, list(out.iterdir()))  # nothing left behind
        assert sorted(p.name for p in (tmp_path / "in").iterdir()) == before


def test_predict_names_a_wrong_type_far_into_the_file(models, tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"t {i}"}) + "\n" for i in range(4999)) + '{"text": 123}\n')
    assert main(["predict", "--model", str(models["classify"]), "--input", str(src), "--output",
                 str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert f"{src}:5000: field 'text' holds 123, expected a text" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl"]


def test_a_bad_byte_is_named_by_line_and_offset(tmp_path):
    p = tmp_path / "q.jsonl"
    p.write_bytes(b'{"query": "a"}\n' * 3 + b'{"query": "\xe9"}\n')
    with pytest.raises(EncoderkitError, match=rf"^{p}:4: not UTF-8 \(byte offset 56\)"):
        list(read_lines(p))


def test_a_model_folder_with_only_a_pickle_or_an_edited_config_is_refused(models, tmp_path, capsys):
    import shutil

    pickled = tmp_path / "pickled"
    shutil.copytree(models["classify"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    src = tmp_path / "in.txt"
    src.write_text("a movie\n")
    assert main(["predict", "--model", str(pickled), "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                 "--backend", "torch-fp32"]) == 2
    err = capsys.readouterr().err
    assert "pytorch_model.bin, a pickle" in err and "never unpickles" in err and "Traceback" not in err
    edited = tmp_path / "edited"
    shutil.copytree(models["classify"], edited)
    config = json.loads((edited / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 7}))
    assert main(["predict", "--model", str(edited), "--input", str(src), "--output", str(tmp_path / "o.jsonl"),
                 "--backend", "torch-fp32"]) == 2
    err = capsys.readouterr().err
    assert "config.json does not match the weights" in err and "Traceback" not in err


def test_a_ray_actor_that_dies_past_its_retries_is_a_message():
    from encoderkit.ray_jobs import _actor_lost

    ActorDiedError = type("ActorDiedError", (Exception,), {})
    e = _actor_lost(ActorDiedError("The actor died unexpectedly before finishing this task.\n\tclass_name: _Worker"))
    assert isinstance(e, EncoderkitError) and "died 4 times" in str(e) and "ActorDiedError" in str(e)
    assert _actor_lost(ValueError("x")) is None


def test_check_input_says_what_a_path_is(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    for path, words in ((tmp_path / "d", "is a folder"), (Path(os.devnull), "is a device"),
                        (tmp_path / "nope", "does not exist"), (tmp_path / "link", "which does not exist")):
        with pytest.raises(EncoderkitError, match=words):
            check_input(path)
    (tmp_path / "f").write_text("x")
    _deny(monkeypatch, tmp_path / "f")
    with pytest.raises(EncoderkitError, match="cannot be read: permission denied"):
        check_input(tmp_path / "f")


# -- outputs never overwrite inputs --------------------------------------------------------------
def test_no_stage_writes_over_its_input(models, index_dir, tmp_path, capsys):
    q = tmp_path / "q.jsonl"
    q.write_text('{"id": "a", "query": "movie"}\n')
    labelled = tmp_path / "l.jsonl"
    labelled.write_text("".join(json.dumps({"text": f"t{i}", "label": "ab"[i % 2], "confidence": 0.9,
                                            "labeller": "x"}) + "\n" for i in range(6)))
    train_dir = tmp_path / "data"
    train_dir.mkdir()
    (train_dir / "train.jsonl").write_text(GOOD_JSONL)
    link = tmp_path / "q-link.jsonl"
    link.symlink_to(q)
    cases = [
        ["search", "--index", str(index_dir), "--queries", str(q), "--output", str(q), "--overwrite"],
        ["search", "--index", str(index_dir), "--queries", str(q), "--output", str(link), "--overwrite"],
        ["predict", "--model", str(models["classify"]), "--input", str(q), "--output", str(q), "--overwrite"],
        ["label", "--labeller", "embed", "--model", str(models["embed"]), "--labels", "a,b", "--input", str(labelled),
         "--output", str(labelled), "--overwrite"],
        ["audit", "sample", "--input", str(labelled), "--output", str(labelled), "--overwrite"],
        ["audit", "suspect", "--input", str(labelled), "--output", str(labelled), "--overwrite"],
        ["finetune", "--task", "classify", "--model", str(models["classify"]), "--train",
         str(train_dir / "train.jsonl"), "--out", str(train_dir), "--overwrite", "--max-steps", "1"],
        ["index", "--model", str(models["embed"]), "--corpus", str(train_dir), "--out", str(train_dir)],
    ]
    snapshot = {p: p.read_bytes() for p in (q, labelled, train_dir / "train.jsonl")}
    for args in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert "writing it would destroy the input" in err and "Traceback" not in err, (args, err)
    assert {p: p.read_bytes() for p in snapshot} == snapshot
    out = tmp_path / "s.jsonl"
    out.write_text("keep")
    assert main(["search", "--index", str(index_dir), "--queries", str(q), "--output", str(out)]) == 2
    assert "exists; pass --overwrite" in capsys.readouterr().err and out.read_text() == "keep"
    assert main(["search", "--index", str(index_dir), "--queries", str(q), "--output", str(out), "--overwrite"]) == 0
    (tmp_path / "a-file").write_text("x")
    assert main(["index", "--model", str(models["embed"]), "--corpus", str(q), "--out", str(tmp_path / "a-file")]) == 2
    assert "is a file, not an index folder" in capsys.readouterr().err
    (tmp_path / "dir-out").mkdir()
    assert main(["label", "--labeller", "embed", "--model", str(models["embed"]), "--labels", "a,b", "--input",
                 str(labelled), "--output", str(tmp_path / "dir-out"), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "is a folder; give a file name" in err and "disk space" not in err


# -- a corpus is what is inside its folder --------------------------------------------------------
def test_links_that_leave_the_corpus_folder_are_skipped_and_counted(models, tmp_path, capsys):
    from encoderkit.data.readers import ReadStats, iter_documents
    from encoderkit.retrieval.corpus import read_corpus

    secret = tmp_path / "secret.txt"
    secret.write_text("the password is swordfish")
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("a document about movies")
    (corpus / "sub" / "b.txt").write_text("another document")
    (corpus / "inside.txt").symlink_to(corpus / "a.txt")  # inside the folder: kept
    (corpus / "out.txt").symlink_to(secret)
    (corpus / "outdir").symlink_to(tmp_path)  # a folder outside (and a cycle)
    read = read_corpus([str(corpus)])
    assert sorted(d.id for d in read.docs) == ["a.txt", "inside.txt", "sub/b.txt"]
    assert len(read.skipped) == 2 and all("leaves the corpus folder" in s for s in read.skipped)
    assert "swordfish" in " ".join(d.text for d in read_corpus([str(corpus)], follow_links=True).docs)
    stats = ReadStats()
    docs = [d.text for d in iter_documents(str(corpus), stats=stats)]
    assert "the password is swordfish" not in docs and len(docs) == 3 and stats.skipped_links == 2
    capsys.readouterr()
    assert main(["index", "--model", str(models["embed"]), "--corpus", str(corpus), "--out", str(tmp_path / "idx"),
                 "--backend", "torch-fp32"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["documents"] == 3 and summary["skipped"] == 2
    passages = (tmp_path / "idx").rglob("passages.jsonl")
    assert "swordfish" not in "".join(p.read_text() for p in passages)


# -- temporaries of a killed run -----------------------------------------------------------------
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_next_run_removes_what_a_killed_run_left(models, tmp_path, capsys):
    pid = _dead_pid()
    out = tmp_path / "p.jsonl"
    stale_file = tmp_path / f".p.jsonl.tmp-{pid}-deadbeef"
    stale_file.write_text("half written")
    stale_dir = tmp_path / f".p.jsonl.old-{pid}-123"
    stale_dir.mkdir()
    live = tmp_path / f".p.jsonl.tmp-{os.getppid()}-cafe0000"  # a live process's: a concurrent writer, kept
    live.write_text("being written")
    other = tmp_path / f".other.jsonl.tmp-{pid}-deadbeef"  # another output's: not this run's business
    other.write_text("x")
    src = tmp_path / "in.txt"
    src.write_text("a movie\n")
    assert main(["predict", "--model", str(models["classify"]), "--input", str(src), "--output", str(out)]) == 0
    assert not stale_file.exists() and not stale_dir.exists() and live.exists() and other.exists()
    assert "left by a run that was killed" in capsys.readouterr().err
    sheet = tmp_path / "sheet.csv"
    stale_sheet = tmp_path / f".sheet.csv.tmp-{pid}-00112233"
    stale_sheet.write_text("row,text\n")
    write_text_atomic(sheet, "row,text,label,confidence,suspicion,suspect,gold\n")  # how review rewrites its sheet
    assert not stale_sheet.exists()
    assert sweep_stale(sheet) == 0


def test_a_predict_killed_mid_write_leaves_a_temp_the_rerun_removes(models, tmp_path):
    src, out = tmp_path / "in.txt", tmp_path / "o.jsonl"
    src.write_text("".join(f"movie {i}\n" for i in range(50)))
    code = (f"import os, signal, sys; sys.argv = ['encoderkit']\n"
            f"from encoderkit.inference import predictor\n"
            f"real = predictor.predict_records\n"
            f"def kill(*a, **k):\n    os.kill(os.getpid(), signal.SIGKILL)\n"
            f"predictor.predict_records = kill\n"
            f"from encoderkit.cli import main\n"
            f"main(['predict', '--model', {str(models['classify'])!r}, '--input', {str(src)!r}, '--output', "
            f"{str(out)!r}])\n")
    subprocess.run([sys.executable, "-c", code], check=False, cwd=Path(__file__).parent.parent,
                   env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    left = list(tmp_path.glob(".o.jsonl.tmp-*"))
    assert len(left) == 1  # what SIGKILL leaves: nothing could clean up
    assert main(["predict", "--model", str(models["classify"]), "--input", str(src), "--output", str(out)]) == 0
    assert list(tmp_path.glob(".o.jsonl.tmp-*")) == [] and len(out.read_text().splitlines()) == 50
