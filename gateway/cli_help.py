"""What the command lines share: ``--help`` that names every option's default (the README says each command's
does), and a server's end on Ctrl-C."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Names an option's default unless its help already does ("default: --policy", "default: the embedded
    SmolLM2") or there is none (None) to name: no "(default: None)" after a help that says what None means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default is None or ("default:" in text and "%(default)" not in text):
            return action.help
        return super()._get_help_string(action)


def show_defaults(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``ArgumentDefaultsHelpFormatter`` adds a default only to an option that has help text: give each
    option without any, and with a default worth naming, a help that names it."""
    for action in parser._actions:
        if action.help is None and action.option_strings and action.default not in (None, [], (), False):
            action.help = "(default: %(default)s)"
    parser.formatter_class = _DefaultsFormatter
    return parser


def end_by_sigint() -> None:
    """A uvicorn server's ``run`` ended by Ctrl-C: uvicorn drained and closed the server, then raised SIGINT
    again, which the asyncio runner turned into a ``KeyboardInterrupt``. End by that signal (as SIGTERM ends
    the process), without the exception's traceback."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
