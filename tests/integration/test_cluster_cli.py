"""``pd-cluster`` as a user runs it: the real command, the real openai client, clean shutdown.

``ClusterRun`` (also used by ``test_cluster_supervision.py``) starts the command in its own session
and remembers every child it has seen, so teardown can reap them all even when a test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
from pdtest import ROOT, free_port, wait_http_ok


def child_pids(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().split("\0")[:-1]
    except OSError:
        return []


class ClusterRun:
    """One ``pd-cluster --engine sim`` process, its log (stdout and stderr) and the children it ran."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = tmp_path / "cluster.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "gateway.cluster", "--engine", "sim", "--port", str(self.port), *args],
                stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                env={**os.environ, **env} if env else None)
        self.seen: dict[int, list[str]] = {}  # every child pid seen, with its argv

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def children(self) -> dict[int, list[str]]:
        found = {pid: cmdline(pid) for pid in child_pids(self.proc.pid) if alive(pid)}
        self.seen.update(found)
        return found

    def wait_log(self, text: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.log():
            assert time.monotonic() < deadline, f"no {text!r} in the log within {timeout_s}s:\n{self.log()}"
            self.children()
            time.sleep(0.1)

    def wait_ready(self) -> None:
        wait_http_ok(f"{self.url}/readiness", 60, self.proc)
        self.wait_log("pd-cluster ready")
        self.children()

    def wait_children_gone(self, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(alive(pid) for pid in self.seen):
            assert time.monotonic() < deadline, "children outlived pd-cluster"
            time.sleep(0.1)

    def reap(self) -> None:
        """Teardown: SIGTERM (pd-cluster reaps its children), else SIGKILL it and every child seen."""
        self.children()
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.children()
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        for pid, argv in self.seen.items():
            if alive(pid) and cmdline(pid) == argv:
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while any(alive(pid) for pid in self.seen) and time.monotonic() < deadline:
            time.sleep(0.05)


@contextmanager
def cluster_run(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[ClusterRun]:
    run = ClusterRun(tmp_path, *args, env=env)
    try:
        yield run
    finally:
        run.reap()


def test_pd_cluster_serves_openai_and_cleans_up_on_sigterm(tmp_path: Path) -> None:
    with cluster_run(tmp_path) as run:
        run.wait_ready()
        c = openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = c.chat.completions.create(model="sim", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        assert whole.choices[0].message.content and whole.usage and whole.usage.completion_tokens == 8
        pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="sim", messages=messages, max_tokens=8, stream=True) if ch.choices]  # type: ignore[arg-type]
        assert "".join(pieces) == whole.choices[0].message.content
        children = run.children()
        assert len(children) == 4, f"bootstrap + prefill + decode + gateway, got {children}"
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(30) == 0
        run.wait_children_gone()


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_ipv6_wildcard_host_serves_ipv4_and_ipv6_clients(tmp_path: Path) -> None:
    """``--host ::`` is every interface of both families, as the docs say: every listener (registry, workers'
    native, HTTP and KV ports, gateway) takes IPv4 connections too (each was IPv6 only: the cluster, reaching
    its children on 127.0.0.1, never became ready)."""
    import pytest

    if not _has_ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    with cluster_run(tmp_path, "--host", "::") as run:
        run.wait_ready()
        for base in (run.url, f"http://[::1]:{run.port}"):
            c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
            out = c.completions.create(model="sim", prompt="Both families", max_tokens=4)
            assert out.choices[0].finish_reason == "length"


def test_a_proxy_in_the_environment_does_not_come_between_the_children(tmp_path: Path) -> None:
    """An http_proxy set for the host's outbound traffic (here one that refuses every connection), without a
    no_proxy for loopback: the registry clients and health checks go to the children directly."""
    dead = f"http://127.0.0.1:{free_port()}"
    proxies = {"http_proxy": dead, "HTTP_PROXY": dead, "https_proxy": dead, "HTTPS_PROXY": dead,
               "all_proxy": dead, "ALL_PROXY": dead, "no_proxy": "", "NO_PROXY": ""}
    with cluster_run(tmp_path, "--startup-timeout-s", "60", env=proxies) as run:
        run.wait_ready()
        c = openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=60)
        assert c.completions.create(model="sim", prompt="no proxy", max_tokens=3).choices[0].finish_reason == "length"
