"""README's CLI table: "every command's ``--help`` shows its defaults". An option with a default
(not a flag, not a repeatable list) must say it in ``--help``."""

from __future__ import annotations

import argparse

import pytest

from gateway import cli as gateway_cli
from gateway import cluster
from workers import cli as worker_cli


def _parsers() -> list[argparse.ArgumentParser]:
    return [gateway_cli.build_parser(), cluster.build_parser(), worker_cli.build_parser()]


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_every_default_is_in_help(parser: argparse.ArgumentParser) -> None:
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.option_strings or action.default in (None, argparse.SUPPRESS, [], False):
            continue
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text:
            missing.append(action.option_strings[-1])
    assert not missing, f"{parser.prog} --help shows no default for {missing}"
