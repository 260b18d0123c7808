"""``pd-cluster --worker-arg`` / ``--gateway-arg``: a valid argument reaches its child and the cluster starts. The check
before anything starts parsed a worker's arguments without the ``--bootstrap`` URL every worker gets from the cluster,
so that every ``--worker-arg`` at all, however valid, was refused as a usage error ("a prefill worker needs
--bootstrap URL"); it checks the argument lists the children will get (the cluster's own settings too), each
worker role's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gateway.cluster import _children_args_problem, build_parser


@pytest.mark.parametrize("flags", [
    ["--worker-arg=--grammar-timeout-s=10"],
    ["--worker-arg=--max-http-connections=100", "--worker-arg=--http-keep-alive-timeout-s=2"],
    ["--worker-arg=--same-host-kv=off", "--gateway-arg=--max-client-connections=2048"],
    ["--gateway-arg=--policy-option=prefix_tokens=64", "--policy", "sticky_prefix"],
])
def test_valid_children_args_pass_the_check(flags: list[str]) -> None:
    assert _children_args_problem(build_parser().parse_args(["--engine", "sim", *flags])) is None


@pytest.mark.parametrize(("flags", "named"), [
    (["--worker-arg=--grammar-timeout-s=0"], "grammar_timeout_s"),
    (["--worker-arg=--bootstrap-embedded=7000"], "bootstrap_embedded"),  # (every worker gets --bootstrap)
    (["--worker-arg=--device=cuda"], "device"),  # (the cluster's --engine sim runs on the CPU)
    # what pd-cluster sets for a child itself: every worker would get the one port, a prefill would turn decode
    (["--worker-arg=--port=9000"], "sets --port"),
    (["--worker-arg=--role=decode"], "sets --role"),
    (["--worker-arg=--http-port=9001"], "sets --http-port"),
    (["--gateway-arg=--policy=random"], "sets --policy"),
])
def test_invalid_children_args_are_refused_for_what_they_are(flags: list[str], named: str) -> None:
    problem = _children_args_problem(build_parser().parse_args(["--engine", "sim", *flags]))
    assert problem is not None and named in problem, problem


def _worker_cmdlines(pid: int) -> list[list[str]]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_text().split("\0")[:-1]
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid and "workers.cli" in argv:
            found.append(argv)
    return found


def test_a_cluster_with_a_valid_worker_arg_starts_its_workers_with_it() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cluster", "--engine", "sim", "--port", "0",
                             "--worker-arg=--grammar-timeout-s=10"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        workers: list[list[str]] = []
        while len(workers) < 2 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            workers = _worker_cmdlines(proc.pid)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert len(workers) == 2 and all(argv[-1] == "--grammar-timeout-s=10" for argv in workers), workers
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # (pd-cluster stops its children; its own session)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
