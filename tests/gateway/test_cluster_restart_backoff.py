"""``pd-cluster``'s restart backoff doubles per recent restart of a child, up to 30 s: a long crash loop that
``--max-restarts`` allows (a large one, "never give up", with a long ``--restart-window-s``) must keep being
restarted every 30 s; from its 1,025th restart within the window the doubling overflowed a float and the
supervisor died with an ``OverflowError`` traceback."""

from __future__ import annotations

import time

import pytest

import gateway.cluster as cluster_module
from gateway.cluster import MAX_BACKOFF_S, Child, Cluster


class _Exited:
    returncode = 1

    def poll(self) -> int:
        return 1


@pytest.mark.parametrize("backoff_s", [0.5, 0.0])
def test_a_long_crash_loop_keeps_the_backoff_at_its_cap(monkeypatch: pytest.MonkeyPatch, backoff_s: float) -> None:
    monkeypatch.setattr(cluster_module, "log", lambda message: None)
    cluster = Cluster(max_restarts=100_000, restart_window_s=1e9, restart_backoff_s=backoff_s)
    child = Child("decode-0", ["true"], "http://127.0.0.1:1/health")
    child.proc = _Exited()  # type: ignore[assignment]
    for _ in range(1100):
        cluster.restart(child, "exited with code 1")
        assert child.restart_at is not None
        assert child.restart_at - time.monotonic() <= max(backoff_s, MAX_BACKOFF_S)
    assert child.num_restarts == 1100
    if backoff_s:
        assert child.restart_at is not None and child.restart_at - time.monotonic() > MAX_BACKOFF_S - 1
