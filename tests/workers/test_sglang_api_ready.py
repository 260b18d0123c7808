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
