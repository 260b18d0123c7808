"""Ctrl-C (SIGINT) on the gateway and on pd-bootstrap: the server drains and closes, then the process ends by
the signal it got (as after SIGTERM), without a ``KeyboardInterrupt`` traceback (as the worker: see
``test_worker_startup.py``). uvicorn raises the signal again once closed; the asyncio runner turned that into a
``KeyboardInterrupt`` that nothing caught."""

from __future__ import annotations

import signal
import subprocess

import pytest
from pdtest import Procs, free_port, wait_http_ok

pytestmark = pytest.mark.timeout(60)


def _interrupted(procs: Procs, name: str, health: str, *args: str) -> tuple[int, str]:
    # (the child's SIGINT at its default, as from a terminal: a suite run as a background job has it ignored, which
    # the child would inherit, and uvicorn, once closed, then raises it again to no effect: exit status 0)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = procs.start(name, *args)
    finally:
        signal.signal(signal.SIGINT, previous)
    wait_http_ok(health, 30, proc)
    proc.send_signal(signal.SIGINT)
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{name} did not exit on SIGINT")
    return code, procs.log(name)


def test_ctrl_c_stops_the_gateway_without_a_traceback(procs: Procs) -> None:
    port = free_port()
    code, out = _interrupted(procs, "gateway", f"http://127.0.0.1:{port}/health", "-m", "gateway.cli", "--port",
                             str(port), "--log-level", "warning", "--prefill", f"pd://127.0.0.1:{free_port()}",
                             "--decode", f"pd://127.0.0.1:{free_port()}")
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert code == -signal.SIGINT, (code, out[-3000:])  # (ended by the signal, as after SIGTERM)


def test_ctrl_c_stops_pd_bootstrap_without_a_traceback(procs: Procs) -> None:
    port = free_port()
    code, out = _interrupted(procs, "bootstrap", f"http://127.0.0.1:{port}/health", "-m", "bootstrap.cli",
                             "--port", str(port), "--log-level", "warning")
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert code == -signal.SIGINT, (code, out[-3000:])
