"""``loadtests/opcount.py`` (``bench_work.py``'s counter): a script run under it gets its own argv, and
counts cover exactly the window between ``SIGUSR1`` and ``SIGUSR2``, per function."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

SERVER = '''
import sys, time
def work(n):
    total = 0
    for i in range(n):
        total += i
    return total
def idle():
    pass
out, phase = sys.argv[1], "before"
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    work(int(sys.argv[2]))
    time.sleep(0.01)
    try:
        open(out).close()
        break
    except OSError:
        pass
'''


def test_counts_cover_the_window_between_the_signals(tmp_path: Path) -> None:
    script, out = tmp_path / "server.py", tmp_path / "counts.json"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, "loadtests/opcount.py", str(out), str(script), str(out), "50"])
    try:
        time.sleep(0.5)
        assert proc.poll() is None, "the script did not get its own argv"
        proc.send_signal(signal.SIGUSR1)
        time.sleep(0.5)
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(30) == 0  # (it stops once the counts are written)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    rows = {where.rsplit("(", 1)[1].rstrip(")"): (ops, calls) for ops, calls, where in json.loads(out.read_text())}
    ops, calls = rows["work"]
    assert 10 <= calls <= 60, calls  # about one call per 10 ms of the half second counted, not since start
    assert ops >= calls * 50 * 3, (ops, calls)  # its loop of 50 ran, a few opcodes per turn
    assert "idle" not in rows  # never called: nothing counted for it
