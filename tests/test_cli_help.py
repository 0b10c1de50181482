"""Every stage's ``--help`` formats and exits 0 (the whole stage table, not one demo stage), and a
command with sub-commands lists them on ``--help``."""

from __future__ import annotations

import re

import pytest

from encoderkit.cli import STAGES, add_config_flags, main


@pytest.mark.parametrize("words", list(STAGES), ids=" ".join)
def test_every_stage_help_formats(words, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*words, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: encoderkit {' '.join(words)}") and "--config FILE" in out


@pytest.mark.parametrize("group", sorted({w[0] for w in STAGES if len(w) > 1}))
def test_a_command_with_subcommands_lists_them(group, capsys):
    assert main([group, "--help"]) == 0
    out = capsys.readouterr().out
    subs = [" ".join(w) for w in STAGES if len(w) > 1 and w[0] == group]
    assert subs and all(s in out for s in subs)
    assert main([group]) == 2 and "needs a subcommand" in capsys.readouterr().err


def test_a_percent_sign_in_a_help_string_is_shown_as_written():
    import argparse
    from dataclasses import dataclass

    from encoderkit.config import StageConfig, arg

    @dataclass
    class Demo(StageConfig):
        drop: float = arg(0.03, help="keep 97% of the quality; 80%% stays 80%")

    p = argparse.ArgumentParser(prog="demo")
    add_config_flags(p, Demo)
    assert "keep 97% of the quality; 80% stays 80%" in " ".join(p.format_help().split())


def test_distill_to_static_help_lists_only_the_flags_that_apply(capsys):
    """`distill --to static --help` lists the flags distill_static reads, not the task distillation's (issue 53);
    plain `distill --help` still lists them all, and a run still parses any flag."""
    from dataclasses import fields

    from encoderkit.compress.distill import DistillConfig

    for argv in (["distill", "--to", "static", "--help"], ["distill", "--help", "--to=static"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert "--teacher" in out and "--dims" in out and "--fit-texts" in out and "--weighting" in out
        for flag in ("--mode", "--temperature", "--kl-weight", "--miner", "--layers", "--resume", "--matryoshka-dims"):
            assert not re.search(rf"^  {flag}\b|\[{flag}\b", out, re.MULTILINE), flag  # an option, not a mention
        assert "The flags that apply with --to static" in out
    with pytest.raises(SystemExit):
        main(["distill", "--help"])
    full = capsys.readouterr().out
    assert "--temperature" in full and "--miner" in full and "--dims" in full
    static = DistillConfig.FLAG_VIEWS["to"]["static"]
    assert set(static) <= {f.name for f in fields(DistillConfig)}  # a renamed field would vanish from the help
