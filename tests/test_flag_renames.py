"""Flags say one thing each: ``--backend`` is the Predictor backend everywhere, the vector store is
``--store``, the quantisation format ``--format``. The old spellings (index/search ``--runtime`` and
``--backend local|milvus``, quantize ``--backend torch|onnx``) work for one release, on the command
line, in config files, in recipe steps and as keyword arguments, and each says once what to write
instead; ``--help`` shows the new names only; an index written before the rename is still read."""

from __future__ import annotations

import json

import pytest
from deploy_models import make_task_model, tiny_root

from encoderkit import config
from encoderkit.cli import build_parser, config_from_args, main
from encoderkit.compress.quantize import QuantizeConfig
from encoderkit.compress.stack import CompressConfig, validate_recipe
from encoderkit.errors import EncoderkitError
from encoderkit.retrieval.index import IndexConfig
from encoderkit.retrieval.search import SearchConfig, Searcher

GONE = "is removed in the next release"


@pytest.fixture(autouse=True)
def _fresh_deprecations(monkeypatch):
    monkeypatch.setattr(config, "SAID", set())  # each test sees every deprecation said anew


@pytest.fixture(scope="module")
def embed_dir(tmp_path_factory, tiny_tokenizer_dir):
    return make_task_model(tiny_root(tmp_path_factory), tiny_tokenizer_dir, "embed")


CONFIGS = {("index",): IndexConfig, ("search",): SearchConfig, ("quantize",): QuantizeConfig, ("compress",): CompressConfig}


def _parse(words: tuple[str, ...], argv: list[str]):
    """The stage config ``encoderkit WORDS ARGV`` would run with."""
    return config_from_args(CONFIGS[words], build_parser(words).parse_args(argv))


def _said(err: str, old: str, new: str) -> int:
    """How many times ``err`` says ``old`` is deprecated in favour of ``new``."""
    return sum(f"{old} is deprecated, use {new} instead" in line and GONE in line for line in err.splitlines())


INDEX = ["--model", "m", "--corpus", "c", "--out", "o"]


# -- the command line ------------------------------------------------------------------------
def test_old_index_flags_mean_the_new_ones_and_say_so_once(capsys):
    for _ in range(2):  # said once per process, however often the flags are read
        cfg = _parse(("index",), [*INDEX, "--runtime", "torch-fp32", "--backend", "milvus", "--uri", "x.db"])
        assert (cfg.backend, cfg.store) == ("torch-fp32", "milvus")
    err = capsys.readouterr().err
    assert _said(err, "--runtime", "--backend") == 1 and _said(err, "--backend milvus", "--store milvus") == 1


def test_old_search_flags_mean_the_new_ones(capsys):
    cfg = _parse(("search",), ["--index", "i", "--query", "q", "--runtime", "onnx-int8", "--backend", "local"])
    assert (cfg.backend, cfg.store) == ("onnx-int8", "local")
    err = capsys.readouterr().err
    assert _said(err, "--runtime", "--backend") == 1 and _said(err, "--backend local", "--store local") == 1


def test_old_quantize_flag_means_format(capsys):
    assert _parse(("quantize",), ["--backend", "onnx"]).format == "onnx"
    assert _said(capsys.readouterr().err, "--backend", "--format") == 1


def test_new_flags_say_nothing(capsys):
    cfg = _parse(("index",), [*INDEX, "--backend", "onnx-fp32", "--store", "milvus", "--uri", "x.db"])
    assert (cfg.backend, cfg.store) == ("onnx-fp32", "milvus")
    assert _parse(("search",), ["--index", "i", "--query", "q", "--backend", "torch-fp32"]).backend == "torch-fp32"
    assert _parse(("quantize",), ["--format", "onnx"]).format == "onnx"
    assert _parse(("compress",), ["--recipe", "r", "--model", "m", "--dev", "d", "--out", "o",
                                  "--runtime", "torch"]).runtime == "torch"  # compress's --runtime keeps its one meaning
    assert "deprecated" not in capsys.readouterr().err


def test_an_old_and_a_new_spelling_of_one_setting_are_refused(capsys):
    assert main(["index", *INDEX, "--runtime", "onnx-fp32", "--backend", "torch-fp32"]) == 2
    assert "both set --backend" in capsys.readouterr().err
    assert main(["quantize", "--backend", "onnx", "--format", "torch"]) == 2


def test_help_lists_only_the_new_names(capsys):
    for words, new, old in ((("index",), ("--backend", "--store"), ("--runtime", "onnx-int8,local")),
                            (("search",), ("--backend", "--store"), ("--runtime",)),
                            (("quantize",), ("--format",), ("--backend",))):
        with pytest.raises(SystemExit):
            main([*words, "--help"])
        out = capsys.readouterr().out
        assert all(n in out for n in new) and not any(o in out for o in old), words
    with pytest.raises(SystemExit):
        main(["index", "--help"])
    assert "--backend {auto,torch-fp32," in capsys.readouterr().out  # the store's values stay hidden there


# -- config files, recipe steps, keyword arguments ---------------------------------------------
@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_old_keys_in_a_config_file(tmp_path, capsys, suffix):
    path = tmp_path / f"index{suffix}"
    path.write_text('runtime = "torch-fp32"\nbackend = "milvus"\nuri = "x.db"\n' if suffix == ".toml"
                    else "runtime: torch-fp32\nbackend: milvus\nuri: x.db\n")
    cfg = _parse(("index",), ["--config", str(path), *INDEX])
    assert (cfg.backend, cfg.store) == ("torch-fp32", "milvus")
    err = capsys.readouterr().err
    assert _said(err, "'runtime'", "'backend'") == 1 and _said(err, "'backend: milvus'", "'store: milvus'") == 1
    assert str(path) in err


def test_an_old_flag_wins_over_a_new_key_in_the_file(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text("format: torch\n")
    assert _parse(("quantize",), ["--config", str(path), "--backend", "onnx"]).format == "onnx"


def test_old_key_in_a_recipe_step(capsys):
    steps = validate_recipe({"steps": [{"lever": "quantize", "method": "dynamic", "backend": "onnx"}]}, "r.yaml")
    assert steps[0].params == {"method": "dynamic", "format": "onnx"} and steps[0].calls[0]["format"] == "onnx"
    # the shorthand's own choice (onnx) gives way to the step's old key, as it did to the step's 'backend'
    steps = validate_recipe([{"lever": "quantize", "method": "dynamic-int8", "backend": "torch"}], "r.yaml")
    assert steps[0].calls == [{"method": "dynamic", "format": "torch"}]
    err = capsys.readouterr().err
    assert _said(err, "'backend'", "'format'") == 1 and "r.yaml: step 1 (lever 'quantize')" in err  # the same words: once
    validate_recipe([{"lever": "quantize", "method": "dynamic", "format": "onnx"}], "new.yaml")
    assert "deprecated" not in capsys.readouterr().err


def test_old_keyword_arguments_and_the_card_keys(capsys):
    q = QuantizeConfig(backend="onnx", measure=False)
    assert q.format == "onnx" and "format" in q.to_dict() and "backend" not in q.to_dict()
    s = SearchConfig(index="i", query="q", runtime="torch-fp32", backend="milvus", uri="u")
    assert (s.backend, s.store) == ("torch-fp32", "milvus")
    assert IndexConfig(model="m", corpus=["c"], out="o", runtime="onnx-int8").backend == "onnx-int8"
    assert _said(capsys.readouterr().err, "'runtime'", "'backend'") == 2  # once for SearchConfig, once for IndexConfig
    with pytest.raises(EncoderkitError, match="'runtime' and 'backend' both set 'backend'"):
        IndexConfig(model="m", corpus=["c"], out="o", runtime="onnx-int8", backend="torch-fp32")


# -- an index folder written before the rename -----------------------------------------------------
def test_an_index_built_with_the_old_flags_and_an_old_manifest_are_read(embed_dir, tmp_path, capsys):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{i}", "text": f"document {i} python data movie"}) + "\n" for i in range(6)))
    out = tmp_path / "idx"
    assert main(["index", "--model", str(embed_dir), "--corpus", str(corpus), "--out", str(out), "--runtime", "torch-fp32",
                 "--backend", "local", "--passage-tokens", "16", "--overlap", "4"]) == 0
    manifest_path = out / (out / "CURRENT").read_text().strip() / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    # both keys for one release: the release before the rename reads 'runtime'
    assert manifest["model"]["backend"] == manifest["model"]["runtime"] == "torch-fp32"
    manifest["model"]["runtime"] = manifest["model"].pop("backend")  # as an index written before the rename
    manifest_path.write_text(json.dumps(manifest))
    assert Searcher.open(out).predictor.backend == "torch-fp32"  # the backend it was built with, from 'runtime'
    capsys.readouterr()
    config.SAID.clear()  # as in a new process: the index run said the same words
    assert main(["search", "--index", str(out), "--query", "python", "--k", "2", "--runtime", "torch-fp32"]) == 0
    captured = capsys.readouterr()
    assert _said(captured.err, "--runtime", "--backend") == 1 and json.loads(captured.out)["hits"]
