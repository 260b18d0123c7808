"""The gateway's start-up in the background (``Gateway.launch``): readiness means a request is served,
one tokenizer fetch at a time, and the garbage of the wait is collected before start-up is frozen."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from test_runtime_config import StandIn, tokenizer_files

from gateway.app import status
from gateway.errors import NoWorkers
from gateway.runtime import Gateway, GatewayConfig


def test_ready_means_requests_are_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """/readiness says 200 only when a request would be served: the port opens before the tokenizer is
    fetched and loaded, and readiness said 200 while the fetch ran and every request was a 503."""
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))

    async def main() -> None:
        worker = await StandIn("a", files=tokenizer_files()).start()
        gw = Gateway(GatewayConfig(worker=(worker.url,), startup_timeout_s=30))
        try:
            gw.launch()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while not status(gw)["ready"]:
                assert loop.time() < deadline
                await asyncio.sleep(0)
            try:
                gw.require_frontend()
            except NoWorkers as exc:
                pytest.fail(f"/readiness is 200 but a request gets a 503: {exc.message}")
        finally:
            await gw.aclose()
            await worker.stop()

    asyncio.run(main())


def test_a_request_before_the_pair_and_the_start_up_fetch_the_tokenizer_once(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A request while the decode is still down starts a tokenizer fetch from the prefill; the decode comes
    up while that fetch runs: the start-up waits for that fetch (it started a second one over it: the
    worker was asked twice, and the first task was no longer the one ``aclose`` cancels)."""
    monkeypatch.setenv("PD_GATEWAY_CACHE", str(tmp_path))
    from pdtest import free_port

    async def main() -> None:
        prefill = await StandIn("p", role="prefill", files=tokenizer_files(), files_delay_s=1.5).start()
        decode_port = free_port()
        gw = Gateway(GatewayConfig(prefill=(prefill.url,), decode=(f"pd://127.0.0.1:{decode_port}",),
                                   startup_timeout_s=30))
        decode = None
        try:
            gw.launch()
            assert await gw.prefills[0].wait_ready(10)
            with pytest.raises(NoWorkers, match="fetching the tokenizer"):
                gw.require_frontend()  # (a request: it starts the fetch)
            first = gw._tokenizer_fetch
            decode = await StandIn("d", role="decode", files=tokenizer_files()).start(decode_port)
            assert await gw.decodes[0].wait_ready(10)
            await asyncio.sleep(2.5)
            assert gw.frontend is not None
            assert prefill.asked == 1 and gw._tokenizer_fetch is first, (prefill.asked, first, gw._tokenizer_fetch)
        finally:
            await gw.aclose()
            await prefill.stop()
            if decode is not None:
                await decode.stop()

    asyncio.run(main())


def test_the_late_freeze_does_not_freeze_garbage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The freeze once the first workers are there collects first: the cyclic garbage made while they were
    waited for (reconnect tries' exceptions, requests answered 503 meanwhile) is freed, not frozen for good."""
    import gc

    from gateway.app import create_app

    frozen_garbage: list[int] = []
    real_freeze = gc.freeze

    def freeze() -> None:
        frozen_garbage.append(gc.collect())  # (what a collection would free now; the first call follows one)
        real_freeze()

    monkeypatch.setattr(gc, "freeze", freeze)

    async def main() -> None:
        app = create_app(GatewayConfig(prefill=("pd://127.0.0.1:9",), decode=("pd://127.0.0.1:10",),
                                       startup_timeout_s=2))
        q_in: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        q_out: asyncio.Queue[dict[str, str]] = asyncio.Queue()
        await q_in.put({"type": "lifespan.startup"})
        task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, q_in.get,
                                       q_out.put))
        assert (await q_out.get())["type"] == "lifespan.startup.complete"
        await asyncio.sleep(2.5)
        await q_in.put({"type": "lifespan.shutdown"})
        await q_out.get()
        await task

    try:
        asyncio.run(main())
    finally:
        gc.unfreeze()
    assert len(frozen_garbage) == 2 and frozen_garbage[1] == 0, frozen_garbage
