"""Run the registry inside another process's event loop (``pd-worker --bootstrap-embedded PORT``).

Lifecycle:
1. ``await serve_embedded(host, port, config)`` binds the listening socket itself (a bind error
   raises ``BootstrapError`` here instead of uvicorn's ``sys.exit``), starts uvicorn's server as
   a named task on the running loop and returns once it accepts connections.
2. The host process keeps its own signal handlers: the embedded server installs none.
3. ``await handle.aclose()`` asks the server to exit, waits up to ``shutdown_timeout_s`` for
   in-flight requests, then cancels; the socket is closed either way. Idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import Iterator

import uvicorn

from bootstrap.app import RegistryState, create_app, guarded_http
from bootstrap.config import BootstrapConfig
from bootstrap.exceptions import BootstrapError
from transfer.netaddr import listener

_START_TIMEOUT_S = 10.0


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # The host process owns SIGINT/SIGTERM; it shuts us down with aclose().
        yield


class EmbeddedRegistry:
    """Handle on a registry served inside the caller's loop."""

    def __init__(
        self, server: uvicorn.Server, sock: socket.socket, task: asyncio.Task[None], state: RegistryState
    ) -> None:
        self._server = server
        self._sock = sock
        self._task = task
        self.state = state
        self.host, self.port = sock.getsockname()[:2]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def aclose(self, shutdown_timeout_s: float = 5.0) -> None:
        self._server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self._task), timeout=shutdown_timeout_s)
        except Exception:  # timeout, or the server task failed
            self._server.force_exit = True
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        finally:
            self._sock.close()


async def serve_embedded(host: str, port: int, config: BootstrapConfig | None = None) -> EmbeddedRegistry:
    """Serve a registry on ``host:port`` (port 0: any free port, see ``handle.port``) in this loop."""
    config = dataclasses.replace(config or BootstrapConfig(), host=host, port=port)
    sock = None
    try:
        sock = listener(host, port, listen=False)  # (``::``: dual-stack, as every listener of ours)
        sock.listen(1024)
        sock.setblocking(False)
    except OSError as exc:
        if sock is not None:
            sock.close()
        raise BootstrapError(f"cannot serve the bootstrap registry on {host}:{port}: {exc}") from exc
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        http=guarded_http(),
        timeout_graceful_shutdown=5,
    )
    server = _EmbeddedServer(uv_config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name=f"bootstrap-embedded-{port}")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + _START_TIMEOUT_S
    while not server.started:
        if task.done() or loop.time() > deadline:
            server.should_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            sock.close()
            raise BootstrapError(f"embedded bootstrap registry on {host}:{port} failed to start")
        await asyncio.sleep(0.01)
    return EmbeddedRegistry(server, sock, task, app.state.registry_state)
