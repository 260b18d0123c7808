"""``--help`` that names every option's default (the README says each command's does)."""

from __future__ import annotations

import argparse


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``ArgumentDefaultsHelpFormatter`` adds a default only to an option that has help text: give each
    option without any, and with a default worth naming, a help that names it."""
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default not in (None, [], (), False):
            action.help = "(default: %(default)s)"
    return parser
