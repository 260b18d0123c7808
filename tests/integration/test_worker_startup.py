"""Startup errors name the problem and exit non-zero (no half-started worker)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", "--role", "both", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_config_json(tmp_path: Path) -> None:
    out = run_worker("--engine", "torch", "--model", str(tmp_path))
    assert out.returncode != 0 and "config.json" in out.stderr


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    out = run_worker("--engine", "torch", "--model", str(tmp_path))
    assert out.returncode != 0 and "mamba" in out.stderr


def test_unknown_engine_and_bad_flags() -> None:
    out = run_worker("--engine", "warp-drive")
    assert out.returncode != 0 and "warp-drive" in out.stderr and "sim" in out.stderr
    out = run_worker("--page-size", "0")
    assert out.returncode != 0 and "page_size" in out.stderr


def test_a_prefill_needs_a_registry() -> None:
    """A prefill registers its KV endpoint; a decode needs none (each request names its prefill's registry)."""
    out = subprocess.run([sys.executable, "-m", "workers.cli", "--role", "prefill"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "bootstrap" in out.stderr
