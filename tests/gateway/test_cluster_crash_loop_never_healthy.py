"""``pd-cluster``'s crash-loop stop must also catch a child that never comes back: one whose restarts each
die (or stay unhealthy) for longer than ``--restart-window-s`` before failing. A torch worker that loads its
model for a minute and then crashes, with the default 60 s window, or one that hangs at startup until the
600 s ``--startup-timeout-s`` kills it: each failure found the previous restarts aged out of the window, so
the supervisor restarted it for ever and never stopped the cluster (exit 1) as ``--max-restarts`` promises.
Restarts that never became healthy again now count whatever their age."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gateway.cluster as cluster_module
from gateway.cluster import Child, Cluster, CrashLoop, free_port, kill


def test_restarts_that_never_become_healthy_end_in_a_crash_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.setattr(cluster_module, "log", lines.append)
    # Each run of the child outlives the restart window, then dies; nothing ever answers its health check.
    cluster = Cluster(startup_timeout_s=120.0, max_restarts=2, restart_window_s=0.2, restart_backoff_s=0.0,
                      liveness_interval_s=60.0)
    child = Child("decode-0", [sys.executable, "-c", "import time; time.sleep(0.5); raise SystemExit(1)"],
                  f"http://127.0.0.1:{free_port()}/health")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        cluster.spawn(child)  # (as after startup: its first run was healthy)
        assert child.proc is not None
        procs.append(child.proc)
        with pytest.raises(CrashLoop, match="crash loop"):
            while child.num_restarts <= 6:  # (3 failures are allowed to end it: far more means it never would)
                cluster.supervise()
                if child.proc is not procs[-1]:
                    procs.append(child.proc)
                child.proc.wait()  # (it dies on its own: no need to poll the clock)
        assert child.num_restarts == 2, lines
        assert len(procs) == 3
    finally:
        for proc in procs:
            kill(proc)
