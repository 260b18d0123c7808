"""``gateway --port 70000`` (a typo, or 8000 with a digit too many) must stop with a usage error, as
``pd-worker``, ``pd-bootstrap`` and ``pd-cluster`` do. It used to start, log "Uvicorn running on
http://127.0.0.1:70000" and listen on 70000 - 65536 = 4464 instead: clients and probes pointed at the
port given found nothing there, and a port out of range below 0 ended in a getaddrinfo error from uvicorn."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pdtest import ROOT

from gateway import cli as gateway_cli


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
def test_config_refuses_a_port_out_of_range(port: str) -> None:
    args = gateway_cli.build_parser().parse_args(
        ["--prefill", "pd://127.0.0.1:1", "--decode", "pd://127.0.0.1:2", "--port", port])
    with pytest.raises(ValueError, match="not a TCP port"):
        gateway_cli.config_from_args(args)


def test_config_takes_the_edges_of_the_range() -> None:
    for port in ("0", "65535"):
        args = gateway_cli.build_parser().parse_args(
            ["--prefill", "pd://127.0.0.1:1", "--decode", "pd://127.0.0.1:2", "--port", port])
        assert gateway_cli.config_from_args(args).port == int(port)


def test_the_gateway_process_exits_at_once_naming_the_port() -> None:
    try:
        proc = subprocess.run([sys.executable, "-m", "gateway.cli", "--prefill", "pd://127.0.0.1:1",
                               "--decode", "pd://127.0.0.1:2", "--port", "70000"],
                              capture_output=True, text=True, cwd=ROOT, timeout=30)
    except subprocess.TimeoutExpired:  # (it served on port 4464 until killed)
        pytest.fail("gateway --port 70000 started serving instead of refusing the port")
    assert proc.returncode == 1, proc.stderr
    assert "not a TCP port: 70000" in proc.stderr
