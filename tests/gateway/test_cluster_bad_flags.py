"""``pd-cluster`` refuses a bad flag as a usage error (exit 2, the flag named) before it starts anything. A
NaN, zero or negative ``--startup-timeout-s`` started the registry and then stopped the cluster saying it
was "not healthy within nans" (and a NaN one would never have given up on a restarted child that never
became healthy); a page size, page count or chunk size below 1 started the registry and every worker, each
of which then exited during startup (exit 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(("flags", "named"), [
    (["--startup-timeout-s", "nan"], "--startup-timeout-s"),
    (["--startup-timeout-s", "0"], "--startup-timeout-s"),
    (["--startup-timeout-s", "-5"], "--startup-timeout-s"),
    (["--page-size", "0"], "--page-size"),
    (["--num-pages", "-1"], "--num-pages"),
    (["--chunk-size", "0"], "--chunk-size"),
    (["--prefill", "0"], "--prefill"),
    (["--liveness-interval-s", "nan"], "--liveness-interval-s"),
    # the children's own flags, checked by their own parsers and configurations before anything starts
    (["--worker-arg=--grammar-timeout-s=0"], "--worker-arg"),
    (["--worker-arg=--no-such-flag"], "--worker-arg"),
    (["--gateway-arg=--breaker-failure-rate=2"], "--gateway-arg"),
    (["--gateway-arg=--max-client-connections=many"], "--gateway-arg"),
])
def test_a_bad_flag_is_a_usage_error_before_anything_starts(flags: list[str], named: str) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cluster", "--engine", "sim", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _out, err = proc.communicate(timeout=120)  # (pd-cluster reaps whatever it started before it exits)
    finally:
        if proc.poll() is None:
            proc.terminate()  # (its children follow: the parent-death signal)
            proc.communicate()
    assert proc.returncode == 2, err[-2000:]
    assert named in err and "usage: pd-cluster" in err, err[-2000:]
    assert "pd-worker" not in err and "healthy" not in err and "during startup" not in err, err[-2000:]
