"""The registry embedded in a running event loop, and the ``pd-bootstrap`` command line."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable

import httpx
import pytest
from conftest import REPO, RegistryProc, free_port, rank_body, topology

from bootstrap import (
    BootstrapConfig,
    BootstrapError,
    BootstrapRegistrar,
    BootstrapResolver,
    RankRegistration,
    serve_embedded,
)


def test_embedded_registry_serves_and_closes() -> None:
    async def run() -> None:
        handlers_before = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
        handle = await serve_embedded("127.0.0.1", 0, BootstrapConfig(ttl_s=5))
        assert handle.port > 0 and handle.url == f"http://127.0.0.1:{handle.port}"
        await asyncio.sleep(0.1)
        # The host process keeps its signal handlers.
        assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers_before
        registrar = BootstrapRegistrar(
            handle.url,
            RankRegistration(rank_ip="127.0.0.1", rank_port=58000, page_size=16, kv_cache_dtype="auto"),
            interval_s=0.2,
        )
        await registrar.start()
        resolver = BootstrapResolver()
        try:
            assert await asyncio.to_thread(resolver.resolve, "127.0.0.1", handle.port) == ("127.0.0.1", 58000)
            assert handle.state.registry.num_ranks == 1
        finally:
            resolver.close()
            await registrar.aclose()
        await handle.aclose()
        await handle.aclose()  # idempotent
        with pytest.raises(httpx.ConnectError):
            await asyncio.to_thread(httpx.get, f"{handle.url}/health")

    asyncio.run(run())


def test_embedded_bind_conflict_is_a_bootstrap_error() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]

        async def run() -> None:
            with pytest.raises(BootstrapError, match=f"127.0.0.1:{port}"):
                await serve_embedded("127.0.0.1", port, None)

        asyncio.run(run())


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bootstrap.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (["--ttl-s", "-1"], "ttl_s"),
        (["--room-ttl-s", "0"], "room_ttl_s"),
        (["--max-body-bytes", "10"], "max_body_bytes"),
        (["--port", "70000"], "port"),
        (["--token", ""], "token"),
        (["--token-scope", "some"], "token-scope"),
    ],
)
def test_cli_rejects_bad_flags(args: list[str], field: str) -> None:
    result = _cli(*args)
    assert result.returncode == 2
    assert field in result.stderr


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        BootstrapConfig(ttl_s=float("nan"))
    with pytest.raises(ValueError, match="token"):
        BootstrapConfig(token="a b")


def test_cli_token_from_environment(start_registry: Callable[..., RegistryProc]) -> None:
    reg = start_registry(env={"PD_BOOTSTRAP_TOKEN": "from-env"})
    assert topology(reg.url).status_code == 401
    assert topology(reg.url, Authorization="Bearer from-env").status_code == 503
    assert (
        httpx.put(
            f"{reg.url}/route", json=rank_body(), headers={"Authorization": "Bearer from-env"}, timeout=5
        ).status_code
        == 200
    )


def test_cli_port_in_use_exits_nonzero() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        result = _cli("--port", str(taken.getsockname()[1]))
    assert result.returncode != 0


def test_free_port_helper_gives_distinct_ports() -> None:
    assert len({free_port() for _ in range(5)}) >= 2
