"""The shared plumbing: typed configs, the generated CLI, atomic output folders."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from encoderkit import cli
from encoderkit.config import StageConfig, arg, check
from encoderkit.errors import EncoderkitError
from encoderkit.io import output_dir
from encoderkit.models.card import lineage, write_card

REPO = Path(__file__).resolve().parents[1]


@dataclass
class DemoConfig(StageConfig):
    corpus: list[str] = arg(help="inputs", required=True)
    seq_len: int = arg(128, help="tokens per block")
    kind: str = arg("wordpiece", help="tokenizer kind", choices=("wordpiece", "bpe"))
    lowercase: bool = arg(True, help="lowercase text")
    threads: int | None = arg(None, help="CPU threads", speed=True)
    seed: int = arg(0, help="seed")

    def validate(self) -> None:
        check(self.seq_len >= 8, f"seq_len must be at least 8, got {self.seq_len}")


def demo_run(cfg: DemoConfig):
    """Demo stage.

    Returns its config so tests can see what the CLI built."""
    return cfg.to_dict()


@pytest.fixture
def demo_stage(monkeypatch):
    monkeypatch.setitem(cli.STAGES, ("demo",), f"{__name__}:DemoConfig:demo_run")


def test_config_validates_choices_required_and_rules():
    with pytest.raises(EncoderkitError, match="--corpus"):
        DemoConfig()
    with pytest.raises(EncoderkitError, match="not one of"):
        DemoConfig(corpus=["a"], kind="unigram")
    with pytest.raises(EncoderkitError, match="at least 8"):
        DemoConfig(corpus=["a"], seq_len=4)
    cfg = DemoConfig(corpus=["a"], threads=3)
    assert "threads" not in cfg.result_dict() and cfg.to_dict()["threads"] == 3


def test_from_dict_rejects_unknown_keys_and_coerces_types():
    cfg = DemoConfig.from_dict({"corpus": "a.txt,b.txt", "seq-len": "64", "lowercase": "false"})
    assert cfg.corpus == ["a.txt", "b.txt"] and cfg.seq_len == 64 and cfg.lowercase is False
    with pytest.raises(EncoderkitError, match="unknown key.*seqlen"):
        DemoConfig.from_dict({"corpus": ["a"], "seqlen": 3})
    with pytest.raises(EncoderkitError, match="expected int"):
        DemoConfig.from_dict({"corpus": ["a"], "seq_len": "many"})


def test_cli_help_lists_every_field(demo_stage, capsys):
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out = capsys.readouterr().out
    for flag in ("--corpus", "--seq-len", "--kind", "--lowercase", "--no-lowercase", "--threads", "--config"):
        assert flag in out
    assert "speed settings" in out and "tokens per block (default: 128)" in out


@pytest.mark.parametrize("suffix,text", [
    (".yaml", "corpus: [x.txt]\nseq_len: 32\nkind: bpe\n"),
    (".toml", 'corpus = ["x.txt"]\nseq_len = 32\nkind = "bpe"\n'),
])
def test_cli_config_file_and_flag_override(demo_stage, tmp_path, capsys, suffix, text):
    f = tmp_path / f"cfg{suffix}"
    f.write_text(text)
    assert cli.main(["demo", "--config", str(f), "--seq-len", "48", "--no-lowercase"]) == 0
    out = capsys.readouterr().out
    assert '"seq_len": 48' in out and '"kind": "bpe"' in out and '"lowercase": false' in out


def test_global_seed_fills_the_stage_seed_unless_given(demo_stage, tmp_path, capsys):
    import json

    def seed(argv: list[str]) -> int:
        assert cli.main(argv) == 0
        return json.loads(capsys.readouterr().out)["seed"]

    assert seed(["demo", "--corpus", "x"]) == 0
    assert seed(["--seed", "7", "demo", "--corpus", "x"]) == 7
    assert seed(["--seed", "7", "demo", "--corpus", "x", "--seed", "3"]) == 3  # the stage's own flag wins
    f = tmp_path / "c.yaml"
    f.write_text("corpus: [x]\nseed: 5\n")
    assert seed(["--seed", "7", "demo", "--config", str(f)]) == 5  # so does its config file


def test_cli_bad_config_exits_2_with_message(demo_stage, tmp_path, capsys):
    f = tmp_path / "cfg.yaml"
    f.write_text("corpus: [x]\nbogus: 1\n")
    assert cli.main(["demo", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "unknown key(s) bogus" in err and str(f) in err


def test_a_key_spelt_both_ways_is_refused_and_a_flag_replaces_a_dashed_key(demo_stage, tmp_path, capsys):
    with pytest.raises(EncoderkitError, match="'seq-len' and 'seq_len' both set 'seq_len'"):
        DemoConfig.from_dict({"corpus": ["a"], "seq-len": 16, "seq_len": 32})
    f = tmp_path / "cfg.yaml"
    f.write_text("corpus: [x]\nseq-len: 32\n")
    assert cli.main(["demo", "--config", str(f), "--seq-len", "48"]) == 0
    assert '"seq_len": 48' in capsys.readouterr().out
    f.write_text("corpus: [x]\nseq-len: 32\nseq_len: 16\n")
    assert cli.main(["demo", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "both set 'seq_len'" in err and str(f) in err


@pytest.mark.parametrize("words,argv,old", [
    (("index",), ["--model", "m", "--corpus", "c", "--out", "o"], ["--runtime", "torch-fp32"]),
    (("index",), ["--model", "m", "--corpus", "c", "--out", "o"], ["--backend", "milvus"]),
    (("search",), ["--index", "i", "--query", "q"], ["--runtime", "onnx-int8"]),
    (("quantize",), [], ["--backend", "onnx"]),
])
def test_a_flag_says_one_thing(words, argv, old, capsys):
    """``--backend`` is the Predictor backend, ``--store`` the vector store, ``--format`` the quantisation
    format; no other spelling is read."""
    with pytest.raises(SystemExit) as e:
        cli.build_parser(words).parse_args([*argv, *old])
    assert e.value.code == 2
    assert old[0] in capsys.readouterr().err


def test_output_dir_is_atomic_and_refuses_existing(tmp_path):
    out = tmp_path / "model"
    with pytest.raises(RuntimeError), output_dir(out) as tmp:
        (tmp / "half.bin").write_bytes(b"x")
        raise RuntimeError("boom")
    assert not out.exists() and list(tmp_path.iterdir()) == []

    with output_dir(out) as tmp:
        (tmp / "a.txt").write_text("first")
    assert (out / "a.txt").read_text() == "first"
    with pytest.raises(EncoderkitError, match="--overwrite"), output_dir(out):
        pass
    # a failed overwrite keeps the previous good folder
    with pytest.raises(RuntimeError), output_dir(out, overwrite=True) as tmp:
        (tmp / "a.txt").write_text("second")
        raise RuntimeError("boom")
    assert (out / "a.txt").read_text() == "first"
    with output_dir(out, overwrite=True) as tmp:
        (tmp / "b.txt").write_text("second")
    assert sorted(p.name for p in out.iterdir()) == ["b.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_card_lineage_follows_parents(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_card(a, "pretrain", None, {"x": 1}, {"loss": 2.0})
    write_card(b, "finetune", a, {"y": 2}, {"acc": 0.9}, task="classify")
    chain = lineage(b)
    assert [c["stage"] for c in chain] == ["finetune", "pretrain"]
    assert chain[0]["task"] == "classify" and chain[1]["metrics"]["loss"] == 2.0


@dataclass
class BitsConfig(StageConfig):
    bits: int = arg(8, help="bits", choices=(4, 8))


def bits_run(cfg: BitsConfig):
    """Bits stage."""
    return {"bits": cfg.bits}


def test_cli_integer_choices(monkeypatch, capsys):
    monkeypatch.setitem(cli.STAGES, ("bits",), f"{__name__}:BitsConfig:bits_run")
    assert cli.main(["bits", "--bits", "4"]) == 0
    assert '"bits": 4' in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["bits", "--bits", "3"])


@dataclass
class SlowWriteConfig(StageConfig):
    out: str = arg(help="output folder", required=True)


def slow_write_run(cfg: SlowWriteConfig):
    """Writes half an output folder, then gets SIGTERM (as from a scheduler) before finishing."""
    import os
    import signal

    with output_dir(cfg.out) as tmp:
        (tmp / "half.bin").write_bytes(b"x" * 10)
        os.kill(os.getpid(), signal.SIGTERM)
        (tmp / "never.bin").write_bytes(b"y")


def test_sigterm_unwinds_and_leaves_nothing_half_written(tmp_path):
    """In a process of its own, as a scheduler's kill meets a CLI run (a pytest process that ran OpenVINO
    inference earlier crashed on the signal, which a fresh process does not)."""
    script = (
        "import signal, sys\n"
        "from encoderkit import cli\n"
        "cli.STAGES[('slowwrite',)] = 'tests.test_config_cli_io:SlowWriteConfig:slow_write_run'\n"
        "before = signal.getsignal(signal.SIGTERM)\n"
        f"rc = cli.main(['slowwrite', '--out', {str(tmp_path / 'o')!r}])\n"
        "assert signal.getsignal(signal.SIGTERM) is before, 'the handler is put back'\n"
        "sys.exit(rc)\n")
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 143, done.stderr
    assert "terminated" in done.stderr
    assert list(tmp_path.iterdir()) == []  # neither the output nor a hidden temporary folder