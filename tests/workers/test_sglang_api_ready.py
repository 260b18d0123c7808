"""The worker's SGLang HTTP API connects to its own native port once (``SGLangAPI.ensure_ready``);
requests arriving while that connection is down wait for it side by side, each for its own timeout,
not one after another behind a lock (the k-th would answer its 503 after k timeouts)."""

from __future__ import annotations

import asyncio
import socket
from types import SimpleNamespace

from workers.config import WorkerConfig
from workers.sglang_api import SGLangAPI


def test_requests_wait_for_the_native_connection_side_by_side() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # nothing listens there
    worker = SimpleNamespace(
        config=WorkerConfig(role="decode"), native_port=dead_port,
        engine=SimpleNamespace(info=SimpleNamespace(tokenizer="byte", name="m", max_context=4096)),
        scheduler=SimpleNamespace(stop_tokenizer=None))

    async def main() -> None:
        api = SGLangAPI(worker)  # type: ignore[arg-type]
        waiting, release = 0, asyncio.Event()

        async def wait_ready(timeout_s: float) -> bool:
            nonlocal waiting
            waiting += 1
            await release.wait()
            return False

        api.client.wait_ready = wait_ready  # type: ignore[method-assign]
        calls = [asyncio.create_task(api.ensure_ready(timeout_s=30)) for _ in range(4)]
        for _ in range(50):
            await asyncio.sleep(0.01)
            if waiting == 4:
                break
        assert waiting == 4, f"{waiting} of 4 requests waiting for the connection; the rest queued behind them"
        release.set()
        await asyncio.wait_for(asyncio.gather(*calls), 5)
        assert api.frontend is not None
        await api.aclose()

    asyncio.run(main())


def test_the_worker_http_side_answers_json_for_wrong_paths_methods_and_a_frontend_not_up() -> None:
    """(Starlette's plain-text 404/405 and a 500 traceback from /v1/models before the frontend is up.)"""
    from starlette.testclient import TestClient

    from workers.http_app import create_http_app

    worker = SimpleNamespace(
        config=WorkerConfig(role="decode"), native_port=1, scheduler=None, started=False,
        engine=SimpleNamespace(info=SimpleNamespace(tokenizer="/nonexistent", name="m", max_context=4096)))
    api = SGLangAPI(worker)  # type: ignore[arg-type]

    async def not_up(timeout_s: float = 0.0) -> None:
        return None

    api.ensure_ready = not_up  # type: ignore[method-assign]
    worker.sglang = api
    with TestClient(create_http_app(worker)) as client:  # type: ignore[arg-type]
        for method, path, status in (("GET", "/generate", 405), ("GET", "/nope", 404), ("GET", "/v1/models", 503)):
            reply = client.request(method, path)
            assert reply.status_code == status and reply.headers["content-type"] == "application/json", reply.text
            assert reply.json()["error"]["message"], reply.text
        assert "POST" in client.get("/generate").headers["allow"]


def test_health_generate_is_a_503_stopping_once_the_worker_stops() -> None:
    """SGLang's routers may probe ``/health_generate``: from SIGTERM on it says 503 ``stopping`` (as ``/health``), not
    ``ok`` until the native connection has closed."""
    worker = SimpleNamespace(
        config=WorkerConfig(role="decode"), native_port=1, stopping=False,
        engine=SimpleNamespace(info=SimpleNamespace(tokenizer="byte", name="m", max_context=4096)),
        scheduler=SimpleNamespace(stop_tokenizer=None, is_alive=True, stalled_s=0.0))

    async def main() -> None:
        api = SGLangAPI(worker)  # type: ignore[arg-type]

        async def ready(timeout_s: float = 30.0) -> None:
            return None

        api.ensure_ready = ready  # type: ignore[method-assign]
        api.client = SimpleNamespace(is_connected=True)  # type: ignore[assignment]
        assert (await api.health_generate(None)).status_code == 200  # type: ignore[arg-type]
        worker.stopping = True
        reply = await api.health_generate(None)  # type: ignore[arg-type]
        assert reply.status_code == 503 and b"stopping" in reply.body

    asyncio.run(main())
