"""The chaos runner's cluster: real processes it starts, signals, restarts and always reaps.

Lifecycle (``ChaosCluster``, owned by one ``loadtests/chaos.py`` run):
1. ``await start()``: ``pd-bootstrap``, then every ``pd-worker`` (sim engine, the chosen transfer),
   then ``gateway`` with migration on, each from the console scripts next to this interpreter, each
   in its own session, its output in ``log_dir/NAME.log``; waits for each one's health (the
   gateway's ``/readiness``). Ports are fixed at planning time, so a restarted child comes back
   where the others expect it.
2. Faults act on ``Child`` objects: ``kill()`` (SIGKILL, reaped), ``freeze()`` / ``thaw()``
   (SIGSTOP / SIGCONT), ``await restart()`` (same argv, same ports, waits for health). The admin
   API (``remove_worker`` / ``add_worker``) and the views (``gateway_health``, ``workers``,
   ``metric``, ``load``) are plain HTTP calls on one aiohttp session.
3. ``close()`` (sync, safe to call twice and from ``finally``): SIGCONT + SIGTERM to every child,
   gateway first, SIGKILL to whatever outlives the grace period, reap all, close the logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from gateway.cluster import free_port

BIN = Path(sys.executable).parent  # the console scripts of this environment (pd-worker, gateway, pd-bootstrap)


@dataclass
class Child:
    """One process of the cluster: how to start it, where it answers, and its current incarnation."""

    name: str
    argv: list[str]
    health_url: str
    log_path: Path
    env: dict[str, str]
    role: str = ""  # prefill | decode for workers
    url: str = ""  # pd://host:port for workers
    http_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    spawned: list[subprocess.Popen[bytes]] = field(default_factory=list)  # every incarnation, to check reaping
    num_starts: int = 0
    _log: Any = None

    def spawn(self) -> None:
        if self._log is None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed by ChaosCluster.close
        self._log.write(f"--- chaos: start #{self.num_starts + 1}: {' '.join(self.argv)}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        self.spawned.append(self.proc)
        self.num_starts += 1

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.is_alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait()

    def freeze(self) -> None:
        self.signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal(signal.SIGCONT)

    def close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class ClusterConfig:
    transfer: str = "tcp"
    num_prefill: int = 2
    num_decode: int = 2
    page_size: int = 4
    num_pages: int = 1024
    max_migrations: int = 2
    worker_args: tuple[str, ...] = ()
    prefill_args: tuple[str, ...] = ()
    decode_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_dir: Path = field(default_factory=lambda: Path("chaos-logs"))


class ChaosCluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        config.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
        self.env.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.env.setdefault("MC_LOG_LEVEL", "ERROR")
        if config.transfer == "nixl":
            self.env.setdefault("UCX_TLS", "tcp")
            self.env.setdefault("UCX_NET_DEVICES", "lo")
        port = free_port()
        self.registry = self._child("registry", [str(BIN / "pd-bootstrap"), "--host", "127.0.0.1", "--port",
                                                 str(port), "--log-level", "warning"], f"http://127.0.0.1:{port}/health")
        self.bootstrap_url = f"http://127.0.0.1:{port}"
        # "shm": the same-host path over tcp (the workers' default); a network backend named alone is run
        # with the same-host path off, so that its own bytes cross the loopback
        transfer = ["--transfer", "tcp"] if config.transfer == "shm" else \
            ["--transfer", config.transfer, "--same-host-kv", "off"]
        common = ["--engine", "sim", *transfer, "--page-size", str(config.page_size),
                  "--num-pages", str(config.num_pages), "--log-level", "warning", *config.worker_args]
        self.prefills = [self._worker("prefill", i, [*common, "--bootstrap", self.bootstrap_url,
                                                     *config.prefill_args]) for i in range(config.num_prefill)]
        self.decodes = [self._worker("decode", i, [*common, *config.decode_args]) for i in range(config.num_decode)]
        self.gateway_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.gateway_port}"
        self.gateway = self._child("gateway", [
            str(BIN / "gateway"), "--port", str(self.gateway_port), "--log-level", "warning",
            "--prefill", *[w.url for w in self.prefills], "--decode", *[w.url for w in self.decodes],
            "--max-migrations", str(config.max_migrations), *config.gateway_args,
        ], f"{self.base_url}/readiness")
        self.gateway_pid = 0
        self.session: aiohttp.ClientSession | None = None
        self._closed = False

    def _child(self, name: str, argv: list[str], health_url: str) -> Child:
        return Child(name, argv, health_url, self.config.log_dir / f"{name}.log", self.env)

    def _worker(self, role: str, index: int, args: list[str]) -> Child:
        port, http_port = free_port(), free_port()
        child = self._child(f"{role}{index}", [str(BIN / "pd-worker"), "--role", role, "--port", str(port),
                                               "--http-port", str(http_port), *args],
                            f"http://127.0.0.1:{http_port}/health")
        child.role, child.url, child.http_port = role, f"pd://127.0.0.1:{port}", http_port
        return child

    @property
    def workers(self) -> list[Child]:
        return self.prefills + self.decodes

    @property
    def children(self) -> list[Child]:
        return [self.gateway, *self.workers, self.registry]  # the stopping order

    # -- start / restart -------------------------------------------------------------------------
    async def start(self) -> None:
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        for child in (self.registry, *self.workers):
            child.spawn()
        for child in (self.registry, *self.workers):
            await self.wait_healthy(child, 60.0)
        self.gateway.spawn()
        await self.wait_healthy(self.gateway, 60.0)
        self.gateway_pid = self.gateway.pid

    async def restart(self, child: Child, timeout_s: float = 60.0) -> None:
        if child.is_alive:
            child.kill()
        child.spawn()
        await self.wait_healthy(child, timeout_s)

    async def wait_healthy(self, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if not child.is_alive:
                raise RuntimeError(f"{child.name} exited with {child.proc.returncode if child.proc else '?'} while "
                                   f"starting; its log:\n{child.log_text()[-3000:]}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with self.http.get(child.health_url, timeout=aiohttp.ClientTimeout(total=2)) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{child.name} not healthy at {child.health_url} after {timeout_s:g}s")
            await asyncio.sleep(0.05)

    # -- views -----------------------------------------------------------------------------------
    @property
    def http(self) -> aiohttp.ClientSession:
        assert self.session is not None, "start() first"
        return self.session

    async def get_json(self, url: str, timeout_s: float = 10.0) -> Any:
        async with self.http.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return json.loads(await resp.read())

    async def gateway_health(self, timeout_s: float = 10.0) -> dict[str, Any]:
        body: dict[str, Any] = await self.get_json(f"{self.base_url}/health", timeout_s)
        return body

    async def gateway_workers(self) -> dict[str, dict[str, Any]]:
        """The gateway's view of each worker, by URL (``GET /workers``)."""
        body = await self.get_json(f"{self.base_url}/workers")
        return {w["url"]: w for w in body["workers"]}

    async def metrics(self) -> dict[str, float]:
        """The gateway's Prometheus samples summed per metric name (labels dropped)."""
        async with self.http.get(f"{self.base_url}/metrics") as resp:
            text = await resp.text()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            with contextlib.suppress(ValueError):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return totals

    async def load(self, worker: Child, timeout_s: float = 5.0) -> dict[str, Any]:
        body: dict[str, Any] = await self.get_json(f"http://127.0.0.1:{worker.http_port}/load", timeout_s)
        return body

    async def registered_instances(self) -> int:
        body = await self.get_json(f"{self.bootstrap_url}/instances", 5.0)
        return len(body["instances"])

    # -- admin API -------------------------------------------------------------------------------
    async def remove_worker(self, worker: Child) -> int:
        async with self.http.delete(f"{self.base_url}/workers", params={"url": worker.url}) as resp:
            await resp.read()
            return resp.status

    async def add_worker(self, worker: Child) -> int:
        async with self.http.post(f"{self.base_url}/workers", json={"url": worker.url, "role": worker.role}) as resp:
            await resp.read()
            return resp.status

    # -- stop ------------------------------------------------------------------------------------
    async def aclose(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None

    def close(self, grace_s: float = 10.0) -> None:
        """Stop and reap every child (idempotent; also after a failed start)."""
        if self._closed:
            return
        self._closed = True
        for child in self.children:
            child.thaw()
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        for child in self.children:
            child.close_log()

    @property
    def is_reaped(self) -> bool:
        """Every process this cluster ever started has exited and been waited for."""
        return all(proc.returncode is not None for child in self.children for proc in child.spawned)


def count_tracebacks(children: Sequence[Child]) -> dict[str, int]:
    """Tracebacks each child printed (its whole log, every incarnation)."""
    return {c.name: c.log_text().count("Traceback (most recent call last)") for c in children}


# what a sim decode logs of a room whose KV was another's (``workers.scheduler``: the engine checks KV rows)
KV_MISMATCHES = ("the imported KV is not its prompt's", "its prompt's KV changed while it decoded")


def kv_mismatches(children: Sequence[Child]) -> list[str]:
    """The log lines where a decode found a room's KV not its prompt's (each names the room and its pages)."""
    return [f"{c.name}: {line.strip()}" for c in children for line in c.log_text().splitlines()
            if any(what in line for what in KV_MISMATCHES)]
