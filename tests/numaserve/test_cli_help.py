"""`numaserve ... --help`: every subcommand and flag has a help text that says its default; serve shows the
HTTP options. (tests/cluster/test_cli.py runs the commands.)"""

import argparse
import re

import pytest

from benchmarks.bench_decode import build_parser as build_bench_parser
from numaserve.cli import build_parser, main


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    # `numaserve bench` hands its argv to bench_decode
    return dict(sub.choices) | {"bench": build_bench_parser()}


def option_helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Each option's text in the formatted help, joined over its lines."""
    text = parser.format_help().split("options:", 1)[1]
    blocks = re.split(r"\n  (?=-)", "\n" + text)
    return {block.split()[0].rstrip(","): " ".join(block.split()) for block in blocks if block.strip()}


def test_every_subcommand_has_a_help_text():
    [sub] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {a.dest for a in sub._choices_actions} == set(sub.choices)
    assert all(len(a.help) > 20 for a in sub._choices_actions)


@pytest.mark.parametrize("name", list(subcommands()))
def test_every_flag_of_every_subcommand_has_a_help_text_with_its_default(name):
    parser = subcommands()[name]
    helps = option_helps(parser)
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"]
    for flag in flags:
        assert flag in helps, (name, flag, helps)
        assert "default" in helps[flag] and len(helps[flag]) > len(flag) + 20, (name, flag, helps[flag])
    for action in parser._actions:
        if not action.option_strings:
            assert action.help, (name, action.dest)  # positionals: what they are


def test_serve_help_shows_the_http_options_and_loopback_default(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    helps = option_helps(subcommands()["serve"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--http-port", "--http-host", "--served-model-name"):
        assert flag in out
    assert "127.0.0.1: loopback only" in helps["--http-host"]
    assert "OpenAI-compatible" in helps["--http-port"]


def test_generate_shows_each_engine_fields_own_default():
    helps = option_helps(subcommands()["generate"])
    assert "(default: 512)" in helps["--max-num-batched-tokens"]
    assert "(default: 0.8)" in helps["--temperature"]
    assert "(default: off)" in helps["--speculation"]
