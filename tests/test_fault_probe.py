"""The unseen probe of issue 52, kept: every CLI subcommand over generated bad inputs (empty, binary, bad UTF-8 at the
start, middle and end, wrong JSON types, a folder, the null device, a dangling link, an unreadable file) answers exit
status 2 with one message naming the file (and the line or byte offset of a bad byte), no traceback, and nothing left
under its output; every subcommand with an output refuses one that exists without --overwrite and one that is its
input even with it; a corpus folder means what is inside it.

In-process through ``encoderkit.cli.main`` on tiny models; an unreadable file is simulated by making ``open`` raise
EACCES (the tests run as root, which chmod does not stop)."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from deploy_models import make_task_model, tiny_root
from test_input_faults import _deny

from encoderkit.cli import STAGES, build_parser, main

TEXTS = ["a fine movie about love", "the worst film of the year", "a great story and good fun",
         "dull and boring from the first time", "the best movie i have seen", "a bad film with a dull story"]
GOOD_TXT = "".join(t + "\n" for t in TEXTS * 4)
GOOD_JSONL = "".join(json.dumps({"id": f"d{i}", "text": t, "query": t, "label": ("negative", "positive")[i % 2],
                                  "title": "movie"})
                     + "\n" for i, t in enumerate(TEXTS * 2))
LABELLED = "".join(json.dumps({"text": t, "label": "ab"[i % 2], "confidence": 0.9, "labeller": "x"}) + "\n"
                   for i, t in enumerate(TEXTS * 2))
SHEET = "row,text,label,confidence,suspicion,suspect,gold\n" + "".join(
    f"{i},{t},{'ab'[i % 2]},0.9,,,{'ab'[i % 2]}\n" for i, t in enumerate(TEXTS * 2))
RECIPE = "steps:\n  - lever: quantize\n    method: dynamic-int8\n"
CONFIG = "backend: torch-fp32\n"
GOOD = {".txt": GOOD_TXT, ".jsonl": GOOD_JSONL, ".csv": SHEET, ".yaml": RECIPE, ".labelled.jsonl": LABELLED,
        ".cfg.yaml": CONFIG}


@dataclass(frozen=True)
class Stage:
    """One subcommand as the probe runs it: the suffix of the file it is fed (``ext``), its arguments with that file
    ``f`` and output ``o`` (``args``), and its output: ``"file"``, ``"folder"`` or None."""

    ext: str
    args: object
    output: str | None = None
    folder_input: bool = False  # the probed flag also takes a corpus folder
    folder_only: bool = False  # the probed flag takes only a folder: a file of any content is "not a folder of X"


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_tokenizer_dir):
    root = tiny_root(tmp_path_factory)
    models = {t: make_task_model(root, tiny_tokenizer_dir, t) for t in ("classify", "embed")}
    d = tmp_path_factory.mktemp("probe_env")
    good = {}
    for ext, text in GOOD.items():
        good[ext] = d / f"good{ext}"
        good[ext].write_text(text, encoding="utf-8")
    assert main(["index", "--model", str(models["embed"]), "--corpus", str(good[".jsonl"]), "--out", str(d / "idx"),
                 "--backend", "torch-fp32"]) == 0
    return {"cls": str(models["classify"]), "emb": str(models["embed"]), "tok": str(tiny_tokenizer_dir),
            "idx": str(d / "idx"), "good": good, "cache": str(d / "cache")}


def stages(e: dict) -> dict[str, Stage]:
    cls, emb, tok, good = e["cls"], e["emb"], e["tok"], e["good"]
    lab, sheet = str(good[".labelled.jsonl"]), str(good[".csv"])
    return {
        "tokenizer train": Stage(".txt", lambda f, o: ["tokenizer", "train", "--corpus", f, "--out", o,
                                                       "--vocab-size", "150"], "folder", True),
        "data prepare": Stage(".txt", lambda f, o: ["data", "prepare", "--corpus", f, "--tokenizer", tok, "--out", o,
                                                    "--seq-len", "16"], "folder", True),
        "data inspect": Stage(".txt", lambda f, o: ["data", "inspect", "--data", f], folder_only=True),
        "pretrain": Stage(".txt", lambda f, o: ["pretrain", "--corpus", f, "--tokenizer", tok, "--out", o, "--preset",
                                                "tiny", "--max-steps", "1", "--seq-len", "16", "--batch-size", "2",
                                                "--cache-dir",
                                                e["cache"]], "folder", True),
        "quantize": Stage(".txt", lambda f, o: ["quantize", "--model", cls, "--method", "static", "--calib-data", f,
                                                "--out", o], "folder"),
        "prune": Stage(".jsonl", lambda f, o: ["prune", "--model", cls, "--method", "heads", "--calib-data", f,
                                               "--out", o], "folder"),
        "distill": Stage(".jsonl", lambda f, o: ["distill", "--teacher", cls, "--train", f, "--out", o, "--layers",
                                                 "0", "--max-steps", "1", "--batch-size", "2"], "folder"),
        "compress": Stage(".jsonl", lambda f, o: ["compress", "--recipe", str(good[".yaml"]), "--model", cls, "--dev",
                                                  f, "--out", o], "folder"),
        "compress --recipe": Stage(".yaml", lambda f, o: ["compress", "--recipe", f, "--model", cls, "--dev",
                                                          str(good[".jsonl"]), "--out", o], "folder"),
        "plan": Stage(".jsonl", lambda f, o: ["plan", "--run", "--model", cls, "--dev", f, "--out", o], "folder"),
        "finetune": Stage(".jsonl", lambda f, o: ["finetune", "--task", "classify", "--model", cls, "--train", f,
                                                  "--out", o, "--max-steps", "1", "--batch-size", "2"], "folder"),
        "evaluate": Stage(".jsonl", lambda f, o: ["evaluate", "--model", cls, "--data", f]),
        "export": Stage(".jsonl", lambda f, o: ["export", "--model", cls, "--quantize", "int8-dynamic", "--dev", f,
                                                "--out", o], "folder"),
        "predict": Stage(".jsonl", lambda f, o: ["predict", "--model", cls, "--input", f, "--output", o, "--backend",
                                                 "torch-fp32"], "file"),
        "predict --config": Stage(".cfg.yaml", lambda f, o: ["predict", "--config", f, "--model", cls, "--input",
                                                         str(good[".txt"]), "--output", o], "file"),
        "label": Stage(".jsonl", lambda f, o: ["label", "--labeller", "embed", "--model", emb, "--labels", "a,b",
                                               "--input", f, "--output", o], "file"),
        "label .txt": Stage(".txt", lambda f, o: ["label", "--labeller", "embed", "--model", emb, "--labels", "a,b",
                                                  "--input", f, "--output", o], "file"),
        "audit suspect": Stage(".jsonl", lambda f, o: ["audit", "suspect", "--input", f, "--output", o, "--folds",
                                                       "2"], "file"),
        "audit sample": Stage(".jsonl", lambda f, o: ["audit", "sample", "--input", f, "--output", o], "file"),
        "audit review": Stage(".csv", lambda f, o: ["audit", "review", "--sheet", f]),
        "audit report": Stage(".csv", lambda f, o: ["audit", "report", "--input", lab, "--sheet", f, "--output", o],
                              "file"),
        "audit report --input": Stage(".jsonl", lambda f, o: ["audit", "report", "--input", f, "--sheet", sheet,
                                                              "--output", o], "file"),
        "decide": Stage(".csv", lambda f, o: ["decide", "--sheet", f, "--volume", "1000", "--machine-cost-per-hour",
                                              "1", "--llm-price-per-call", "0.01", "--output", o], "file"),
        "index": Stage(".jsonl", lambda f, o: ["index", "--model", emb, "--corpus", f, "--out", o, "--backend",
                                               "torch-fp32"], "folder", True),
        "search": Stage(".jsonl", lambda f, o: ["search", "--index", e["idx"], "--queries", f, "--output", o],
                        "file"),
        "adapt": Stage(".jsonl", lambda f, o: ["adapt", "--model", emb, "--corpus", f, "--out", o, "--max-steps",
                                               "1", "--batch-size", "2"], "folder", True),
    }


# stages that take a folder of files, or read their input only after the inputs the probe does not spoil
NOT_FED = {"serve", "doctor", "quickstart"}  # serve is long-running (tests/test_serve*); the other two take no file
# a JSONL corpus line that is not UTF-8 is skipped, named and counted by `index` (docs/search.md), not refused
ACCEPTED = {("index", "utf8-start"), ("index", "utf8-middle"), ("index", "utf8-end"),
            ("predict --config", "empty")}  # an empty YAML file is an empty mapping: the flags alone
DUMMY = dict.fromkeys(("cls", "emb", "tok", "idx", "cache"), "") | {"good": dict.fromkeys(GOOD, "")}
NAMES = list(stages(DUMMY))
PROBES = ["empty", "binary", "utf8-start", "utf8-middle", "utf8-end", "wrong-type", "folder", "null-device",
          "dangling-link", "unreadable"]


def _words(name: str) -> tuple[str, ...]:
    """The subcommand a probe entry runs ("compress --recipe" -> compress, "label .txt" -> label)."""
    return tuple(name.split(" --")[0].removesuffix(" .txt").split())


def test_every_subcommand_is_probed():
    assert {" ".join(w) for w in STAGES} - NOT_FED == {" ".join(_words(n)) for n in NAMES}


def _bad(d: Path, kind: str, ext: str) -> Path:
    """The probe ``kind``'s bad input (suffix ``ext``), made in ``d``."""
    good = GOOD[ext].encode()
    half = len(good) // 2
    data = {"empty": b"", "binary": bytes(range(256)) * 8, "utf8-start": b"\xff" + good,
            "utf8-middle": good[:half] + b"\xc3\x28" + good[half:], "utf8-end": good + b"\xfe\n",
            "wrong-type": good + json.dumps({"id": 9, "text": 123, "query": 4, "label": 5, "title": 6}).encode()
            + b"\n", "unreadable": good}.get(kind)
    p = d / f"{kind}{ext}"
    if data is not None:
        p.write_bytes(data)
    elif kind == "folder":
        p.mkdir()
    elif kind == "null-device":
        return Path(os.devnull)
    elif kind == "dangling-link":
        p.symlink_to(d / "gone.txt")
    return p


@pytest.mark.parametrize("name", NAMES)
def test_every_bad_input_is_one_message_and_leaves_nothing(name, env, tmp_path, monkeypatch, capsys):
    stage = stages(env)[name]
    out_root, inputs = tmp_path / "out", tmp_path / "in"
    out_root.mkdir()
    inputs.mkdir()
    failures = []
    for kind in PROBES:
        if (name, kind) in ACCEPTED or (kind == "wrong-type" and stage.ext != ".jsonl"):
            continue
        if kind == "folder" and stage.folder_input:
            continue  # a folder is a corpus here: its links are probed below, its bad files as files
        f = _bad(inputs, kind, stage.ext)
        before = sorted(p.name for p in inputs.iterdir())
        with monkeypatch.context() as mp:
            if kind == "unreadable":
                _deny(mp, f)
            try:
                code = main(stage.args(str(f), str(out_root / "result")))
            except SystemExit as e:  # argparse
                code = e.code
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        problem = None
        if code != 2:
            problem = f"exit {code}"
        elif len(lines) != 1 or "Traceback" in err:
            problem = "not one message"
        elif str(f) not in lines[0] and f.name not in lines[0]:
            problem = "the file is not named"
        elif kind.startswith("utf8") and not stage.folder_only and not re.search(r"(offset \d+|:\d+:)", lines[0]):
            problem = "no line or byte offset"
        elif kind == "unreadable" and not stage.folder_only and "permission denied" not in lines[0]:
            problem = "not said to be a permission problem"
        elif list(out_root.iterdir()):
            problem = f"left {sorted(p.name for p in out_root.iterdir())}"
        elif sorted(p.name for p in inputs.iterdir()) != before:
            problem = "changed the inputs"
        if problem:
            failures.append(f"{kind}: {problem}: {(lines or err.splitlines() or [''])[-1][:300]}")
        for p in out_root.iterdir():  # so that the next probe starts clean
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
    assert not failures, f"{name}:\n" + "\n".join(failures)


@pytest.mark.parametrize("name", [n for n, s in stages(DUMMY).items() if s.output])
def test_an_output_is_never_an_input_nor_replaced_without_overwrite(name, env, tmp_path, capsys):
    stage = stages(env)[name]
    has_overwrite = "--overwrite" in _flags(_words(name))
    inputs = tmp_path / "in"
    inputs.mkdir()
    f = inputs / f"input{stage.ext}"
    f.write_text(GOOD[stage.ext], encoding="utf-8")
    (inputs / "other.txt").write_text("kept\n")
    snapshot = {p.name: p.read_bytes() for p in inputs.iterdir()}
    # 1. the output is the input (a folder output: the folder holding it), even with --overwrite
    same = str(inputs if stage.output == "folder" else f)
    code = main(stage.args(str(f), same) + (["--overwrite"] if has_overwrite else []))
    err = capsys.readouterr().err
    assert code == 2 and "writing it would destroy the input" in err and "Traceback" not in err, (name, err[-800:])
    assert {p.name: p.read_bytes() for p in inputs.iterdir()} == snapshot
    if stage.output == "file":  # ... or a link to it
        link = tmp_path / "link"
        link.symlink_to(f)
        code = main(stage.args(str(f), str(link)) + ["--overwrite"])
        err = capsys.readouterr().err
        assert code == 2 and "writing it would destroy the input" in err, (name, err[-800:])
        assert {p.name: p.read_bytes() for p in inputs.iterdir()} == snapshot
        link.unlink()
    # 2. an output that exists is refused without --overwrite, untouched
    out = tmp_path / "out"
    if stage.output == "folder":
        out.mkdir()
        (out / "keep.txt").write_text("keep")
    else:
        out.write_text("keep")
    code = main(stage.args(str(f), str(out)))
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (name, err[-800:])
    assert "--overwrite" in lines[0] or (name == "index" and "not an index" in lines[0]), (name, lines[0])
    assert (out / "keep.txt" if stage.output == "folder" else out).read_text() == "keep"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in", "out"]  # no temporary left beside it


def _flags(words: tuple[str, ...]) -> str:
    return build_parser(words).format_help()


def test_overwrite_is_documented_on_every_subcommand_with_an_output(env):
    for name, stage in stages(env).items():
        if stage.output and name != "index":  # index updates its folder in place (--rebuild re-embeds it)
            assert re.search(r"--overwrite, --no-overwrite\s+\S", _flags(_words(name))), name


@pytest.mark.parametrize("labeller", ["embed", "cloze"])
def test_label_reads_its_whole_input_before_loading_a_model(labeller, env, tmp_path, monkeypatch, capsys):
    """A bad row, even the last, fails before any model is loaded: the error comes at once, not after the load."""
    import encoderkit.label.run as label_run

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the input was read")

    monkeypatch.setattr(label_run, "EmbedLabeller", loaded)
    monkeypatch.setattr(label_run, "ClozeLabeller", loaded)
    f = tmp_path / "in.jsonl"
    f.write_text(GOOD_JSONL + "\n" + json.dumps({"text": 123}) + "\n", encoding="utf-8")
    extra = ["--pattern", "{text} it was {mask}", "--verbalizer", "a=good", "b=bad"] if labeller == "cloze" else []
    code = main(["label", "--labeller", labeller, "--model", env["emb"], "--labels", "a,b", "--input", str(f),
                 "--output", str(tmp_path / "out.jsonl"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and f"{f}:14: field 'text'" in err and "Traceback" not in err, err[-800:]


# -- a corpus folder means what is inside it -------------------------------------------------------
def _corpus_stage(e: dict, name: str) -> Stage:
    """``name`` as the link probe runs it on a corpus folder: distill's corpus is an embed teacher's --train."""
    if name == "distill":
        return Stage(".txt", lambda f, o: ["distill", "--teacher", e["emb"], "--train", f, "--out", o, "--layers", "0",
                                           "--max-steps", "1", "--batch-size", "1"], "folder", True)
    return stages(e)[name]


@pytest.mark.parametrize("name", ["tokenizer train", "data prepare", "pretrain", "index", "adapt", "distill"])
def test_links_leaving_a_corpus_folder_are_skipped_and_counted_unless_followed(name, env, tmp_path, capsys):
    stage = _corpus_stage(env, name)
    secret = tmp_path / f"secret{stage.ext}"
    secret_text = "swordfish " * 40
    secret.write_text(json.dumps({"id": "s", "text": secret_text}) + "\n" if stage.ext == ".jsonl"
                      else secret_text + "\n")
    corpus = tmp_path / "corpus"
    (corpus / ".store").mkdir(parents=True)
    (corpus / f"a{stage.ext}").write_text(GOOD[stage.ext], encoding="utf-8")
    (corpus / ".store" / f"b{stage.ext}").write_text(GOOD[stage.ext].replace('"d', '"e'), encoding="utf-8")
    (corpus / f"inside{stage.ext}").symlink_to(corpus / ".store" / f"b{stage.ext}")  # a link inside the folder: read
    (corpus / f"z{stage.ext}").symlink_to(secret)  # a link out of it: skipped and counted
    out = tmp_path / "out"
    assert main(stage.args(str(corpus), str(out))) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out[captured.out.index("{"):])
    assert summary.get("skipped_links", summary.get("skipped")) == 1, summary
    assert "leave" in captured.err and "--follow-links" in captured.err
    assert not any("swordfish" in p.read_text(errors="replace") for p in out.rglob("*") if p.is_file()
                   and p.suffix in (".json", ".jsonl", ".txt"))
    if name in ("data prepare", "tokenizer train", "distill"):  # --follow-links reads it
        followed = tmp_path / "followed"
        assert main(stage.args(str(corpus), str(followed)) + ["--follow-links"]) == 0
        captured = capsys.readouterr()
        summary = json.loads(captured.out[captured.out.index("{"):])
        assert summary.get("skipped_links") == 0
        if name == "tokenizer train":
            assert "swordfish" in (followed / "tokenizer.json").read_text()


# -- one line reader everywhere: a U+2028, a form feed and a BOM give the same rows in every reader ---------------
ODD = ["one\u2028two", "three\x0cfour", "five\u2029six\x85seven", "eight\x1cnine"]  # str.splitlines splits each


def _write(path: Path, lines: list[str]) -> Path:
    """``lines`` with a UTF-8 BOM in front and Windows line ends: what Excel and Notepad save."""
    path.write_bytes(b"\xef\xbb\xbf" + "".join(x + "\r\n" for x in lines).encode("utf-8"))
    return path


def test_odd_breaks_and_a_bom_give_the_same_rows_in_every_reader(tmp_path):
    from encoderkit.adapt.passages import eval_data, read_passages
    from encoderkit.compress.task_data import read_task_inputs
    from encoderkit.config import load_mapping
    from encoderkit.data.beir import load_retrieval, read_triples
    from encoderkit.data.readers import iter_documents
    from encoderkit.label.records import read_texts
    from encoderkit.retrieval.corpus import read_corpus
    from encoderkit.tasks.tabular import read_rows

    ids = [f"d{i}" for i in range(len(ODD))]
    jsonl = _write(tmp_path / "c.jsonl", [json.dumps({"id": i, "_id": i, "text": t, "title": "", "query": t,
                                                      "positive": t}, ensure_ascii=False) for i, t in zip(ids, ODD)])
    csv_file = _write(tmp_path / "c.csv", ["id,text"] + [f'{i},"{t}"' for i, t in zip(ids, ODD)])
    tsv = _write(tmp_path / "c.tsv", ["id\ttext"] + [f"{i}\t{t}" for i, t in zip(ids, ODD)])
    txt = _write(tmp_path / "c.txt", ODD)
    for table in (jsonl, csv_file, tsv):
        assert [r.fields["text"] for r in read_rows(table)] == ODD, table  # the task readers (finetune, evaluate)
        assert [d.text for d in iter_documents(str(table))] == ODD, table  # data prepare, tokenizer train, pretrain
    assert [d.text for d in iter_documents(str(txt), doc_split="line")] == ODD
    for corpus in (jsonl, csv_file):
        assert [(d.id, d.text) for d in read_corpus([str(corpus)]).docs] == list(zip(ids, ODD)), corpus  # index
        assert [(p.id, p.text) for p in read_passages(str(corpus))] == list(zip(ids, ODD)), corpus  # adapt
    assert read_task_inputs(str(txt), "classify").texts == ODD  # compression's calibration texts
    assert read_texts(txt, "")[0] == ODD and read_texts(jsonl, "text")[0] == ODD  # label
    assert [t.query for t in read_triples(jsonl)] == ODD  # embed triples
    beir = tmp_path / "beir"
    (beir / "qrels").mkdir(parents=True)
    (beir / "corpus.jsonl").write_bytes(jsonl.read_bytes())
    (beir / "queries.jsonl").write_bytes(jsonl.read_bytes())
    _write(beir / "qrels" / "test.tsv", ["query-id\tcorpus-id\tscore"] + [f"{i}\t{i}\t1" for i in ids])
    data = load_retrieval(f"{beir}#test")
    assert [data.corpus[i][1] for i in ids] == ODD and [data.queries[i] for i in ids] == ODD
    queries = _write(tmp_path / "q.tsv", [f"{i}\t{t}" for i, t in zip(ids, ODD)])
    qrels = _write(tmp_path / "qrels.tsv", [f"{i}\t{i}\t1" for i in ids])
    judged = eval_data(read_passages(str(jsonl)), "", str(queries), str(qrels))
    assert [judged.queries[i] for i in ids] == ODD and len(judged.qrels) == len(ids)
    config = tmp_path / "c.yaml"
    config.write_bytes(b"\xef\xbb\xbfbackend: torch-fp32\r\n")
    assert load_mapping(config) == {"backend": "torch-fp32"}


@pytest.mark.parametrize("reader", ["config", "recipe", "template", "squad", "mask words"])
def test_whole_file_readers_name_a_bad_byte_and_what_a_path_is(reader, tmp_path):
    from encoderkit.compress.stack import read_recipe
    from encoderkit.config import load_mapping
    from encoderkit.data.function_words import read_skip_words
    from encoderkit.errors import EncoderkitError
    from encoderkit.label.prompt import load_template
    from encoderkit.tasks.qa.data import load_squad_json

    read, ext = {"config": (load_mapping, ".yaml"), "recipe": (read_recipe, ".yaml"),
                 "template": (load_template, ".txt"), "squad": (load_squad_json, ".json"),
                 "mask words": (read_skip_words, ".txt")}[reader]
    bad = tmp_path / f"bad{ext}"
    bad.write_bytes(b"a: 1\nb: \xe9\n")
    with pytest.raises(EncoderkitError, match=rf"{re.escape(str(bad))}:2: not UTF-8 \(byte offset 8\)"):
        read(str(bad))
    (tmp_path / f"dir{ext}").mkdir()
    if reader != "template":  # a template that is not a file is the template's text
        with pytest.raises(EncoderkitError, match="folder|does not exist|no such file"):
            read(str(tmp_path / f"dir{ext}"))


def test_an_output_file_inside_an_input_folder_is_refused(env, tmp_path, capsys):
    model, idx = tmp_path / "model", tmp_path / "idx"
    shutil.copytree(env["cls"], model)
    shutil.copytree(env["idx"], idx, symlinks=True)
    q = env["good"][".jsonl"]
    snapshot = {p: p.read_bytes() for p in (model / "config.json", idx / "CURRENT")}
    for args in (["predict", "--model", str(model), "--input", str(q), "--output", str(model / "config.json")],
                 ["search", "--index", str(idx), "--queries", str(q), "--output", str(idx / "CURRENT")]):
        assert main(args + ["--overwrite"]) == 2, args
        err = capsys.readouterr().err
        assert "is a file of the input" in err and "writing it would destroy the input" in err, err[-500:]
    assert {p: p.read_bytes() for p in snapshot} == snapshot
    fresh = model / "predictions.jsonl"  # a new file beside a model's own is not a file of it
    assert main(["predict", "--model", str(model), "--input", str(q), "--output", str(fresh), "--backend",
                 "torch-fp32"]) == 0 and fresh.is_file()
