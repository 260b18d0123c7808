"""``pd-worker --help`` names every option's default, but never a secret: the registry token it takes from
``$PD_BOOTSTRAP_TOKEN`` (as the worker key from ``$PD_WORKER_API_KEY``) is named by its variable, not printed
(its value was shown as ``--bootstrap-token``'s default: in a terminal, a CI log, a pasted bug report). The
token still reaches the worker's configuration from the environment, and a flag still wins over it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdtest import ROOT

from workers import cli as worker_cli

TOKEN, KEY = "s3cr3t-registry-token", "s3cr3t-worker-key"


def test_help_shows_no_secret_from_the_environment() -> None:
    env = {"PD_BOOTSTRAP_TOKEN": TOKEN, "PD_WORKER_API_KEY": KEY, "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "workers.cli", "--help"], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=60, check=True).stdout
    assert "--bootstrap-token" in out
    assert TOKEN not in out and KEY not in out, out
    assert "PD_BOOTSTRAP_TOKEN" in out  # (where the default comes from)


def _token(*flags: str) -> str | None:
    args = worker_cli.build_parser().parse_args(["--role", "prefill", "--bootstrap", "http://127.0.0.1:1", *flags])
    return worker_cli.config_from_args(args).bootstrap_token


def test_the_token_still_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PD_BOOTSTRAP_TOKEN", TOKEN)
    assert _token() == TOKEN
    assert _token("--bootstrap-token", "flag") == "flag"
    monkeypatch.delenv("PD_BOOTSTRAP_TOKEN")
    assert _token() is None
