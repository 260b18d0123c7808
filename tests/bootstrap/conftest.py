"""Fixtures for the bootstrap registry tests: real registry and rank processes on free loopback ports.

Every process started here is reaped at teardown (SIGTERM, then SIGKILL), also when a test fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[2]
RANK_SCRIPT = Path(__file__).with_name("bootstrap_rank_proc.py")
TOPOLOGY_QUERY = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}


def free_port() -> int:
    from pdtest import free_port as pick  # below the ephemeral range (see there)

    return pick()


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["HF_HUB_OFFLINE"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("PD_BOOTSTRAP_TOKEN", None)
    return env


def reap(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@dataclass
class RegistryProc:
    port: int
    args: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RegistryProc:
        cmd = [sys.executable, "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(self.port), *self.args]
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"registry exited with {self.proc.returncode}: {err}")
            try:
                if httpx.get(f"{self.url}/health", timeout=0.5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError("registry did not become healthy")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()


@dataclass
class Procs:
    """Everything a test started; reaped at teardown."""

    items: list[subprocess.Popen[Any]] = field(default_factory=list)
    registries: list[RegistryProc] = field(default_factory=list)

    def add(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        self.items.append(proc)
        return proc


@pytest.fixture
def procs() -> Iterator[Procs]:
    tracked = Procs()
    yield tracked
    for proc in tracked.items:
        reap(proc)
    for reg in tracked.registries:
        if reg.proc is not None:
            reap(reg.proc)
            if reg.proc.stderr:
                reg.proc.stderr.close()


@pytest.fixture
def start_registry(procs: Procs) -> Callable[..., RegistryProc]:
    """Factory: ``start_registry("--ttl-s", "1", port=None, env=None)`` -> a healthy registry process."""

    def start(*args: str, port: int | None = None, env: dict[str, str] | None = None) -> RegistryProc:
        reg = RegistryProc(port=port or free_port(), args=list(args), env={**child_env(), **(env or {})})
        procs.registries.append(reg)
        return reg.start()

    return start


@pytest.fixture
def start_rank(procs: Procs) -> Callable[..., subprocess.Popen[bytes]]:
    """Factory: a separate process that registers one rank with BootstrapRegistrar and heartbeats."""

    def start(
        url: str,
        *,
        rank_port: int,
        instance_id: str = "default",
        tp_size: int = 1,
        tp_rank: int = 0,
        interval_s: float = 0.2,
        page_size: int = 16,
        wait: bool = True,
    ) -> subprocess.Popen[bytes]:
        cmd = [
            sys.executable,
            str(RANK_SCRIPT),
            url,
            instance_id,
            str(rank_port),
            str(tp_size),
            str(tp_rank),
            str(interval_s),
            str(page_size),
        ]
        proc = procs.add(
            subprocess.Popen(cmd, cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        )
        if wait:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode().strip()
            assert line == "REGISTERED", f"rank process failed to register (got {line!r})"
        return proc

    return start


def topology(url: str, instance_id: str | None = None, **headers: str) -> httpx.Response:
    params: dict[str, Any] = dict(TOPOLOGY_QUERY)
    if instance_id is not None:
        params["instance_id"] = instance_id
    return httpx.get(f"{url}/route", params=params, headers=headers, timeout=5)


def rank_body(**overrides: Any) -> dict[str, Any]:
    """A valid PUT /route body in SGLang's shape (one rank, tp=1), with overrides."""
    body: dict[str, Any] = {
        "attn_tp_size": 1,
        "attn_tp_rank": 0,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": 1,
        "attn_dp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": 40000,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False,
        "prefill_http_port": 30000,
    }
    body.update(overrides)
    return body


def wait_until(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()
