"""``loadtests/soak.py`` fails a run in which a process of the cluster died, even one ``pd-cluster`` restarted.

A worker killed mid-soak (the OOM killer: what a soak for memory growth exists to catch) is restarted by
``pd-cluster`` under a new pid; the gateway retries what had not started, so no request need fail. The soak
then read the dead pid's RSS as NaN, and ``NaN - first > slack`` is False: "ok", ``VERDICT: PASS``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)

ROOT = Path(__file__).resolve().parents[2]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return out


def test_a_prefill_killed_mid_soak_fails_the_verdict(tmp_path: Path) -> None:
    log = tmp_path / "soak.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "loadtests/soak.py", "--minutes", "0.25", "--window-s", "4"],
                                cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while "\n  1 " not in log.read_text(errors="replace"):  # the first window's row: RSS baselines read
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        cluster = _children(proc.pid)
        assert len(cluster) == 1, cluster
        prefills = [pid for pid in _children(cluster[0])
                    if b"--role\0prefill" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert prefills, "no prefill worker found"
        os.kill(prefills[0], signal.SIGKILL)
        code = proc.wait(120)
        text = log.read_text(errors="replace")
        verdict = next(line for line in text.splitlines() if line.startswith("VERDICT:"))
        assert code == 1 and verdict.startswith("VERDICT: FAIL"), text
        assert f"prefill-{prefills[0]}" in verdict.split("exited:", 1)[-1], verdict
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
