"""SIGTERM (``timeout``, a cancelled CI job; SIGHUP: a closed terminal) stops a load test as Ctrl-C does: the
servers it started, each in a session of its own, are stopped and reaped, not left running under init.

Python's default for SIGTERM ends the process at once, without ``finally``: ``timeout 60 bench_stack.py``
left the floor, nine fast workers and four gateways running for good, and ``soak.py`` a whole
``pd-cluster``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _descendants(pid: int) -> set[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _terminated_leaves_nothing(tmp_path: Path, args: list[str], ready: str, sig: signal.Signals) -> None:
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 60
        while ready not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"never printed {ready!r}: {log.read_text(errors='replace')}"
            time.sleep(0.1)
        children = _descendants(proc.pid)
        assert children, "the load test started no process"
        proc.send_signal(sig)
        proc.wait(60)
        deadline = time.monotonic() + 15  # (a child stopped meanwhile may take a moment to exit)
        while {p for p in children if _alive(p)} and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {p for p in children if _alive(p)}
        assert not left, f"{len(left)} of {len(children)} processes left running after {sig.name}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in children:  # whatever leaked: ours to end
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_bench_stack_reaps_its_servers_on_sigterm(tmp_path: Path, sig: signal.Signals) -> None:
    _terminated_leaves_nothing(tmp_path, ["loadtests/bench_stack.py", "--quick", "--sections", "fast"],
                               "[floor.c64]", sig)


def test_soak_stops_its_cluster_on_sigterm(tmp_path: Path) -> None:
    _terminated_leaves_nothing(tmp_path, ["loadtests/soak.py", "--minutes", "1", "--window-s", "5",
                                          "--prefill", "1", "--decode", "1"], "soak: ", signal.SIGTERM)
