"""Every stage's ``--help`` formats and exits 0 (the whole stage table, not one demo stage), and a
command with sub-commands lists them on ``--help``."""

from __future__ import annotations

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
