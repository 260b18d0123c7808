"""From the second review of this session's diff: the stop strings bounded in total, the admin API's being off
said at start and its refusal naming every way out, a worker's /metrics scrapable without its key."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import msgspec
import pytest
from starlette.testclient import TestClient

from gateway.api import Frontend, decode_body
from gateway.api_models import MAX_STOP_CHARS, MAX_STOP_STRINGS, CompletionRequest
from gateway.errors import BadRequest
from gateway.runtime import GatewayConfig
from gateway.tokenizer import ByteTokenizer


def _prepare(stops: list[str]) -> object:
    frontend = Frontend(None, ByteTokenizer(), "sim", 4096)  # type: ignore[arg-type]
    body = {"prompt": "hi", "max_tokens": 4, "stop": stops}
    return frontend.prepare_completion(decode_body(msgspec.json.encode(body), CompletionRequest))


def test_stop_strings_are_bounded_in_total_not_only_in_count() -> None:
    """64 strings x 1,024 characters is 8x what a choice carried (and was searched for per token) before:
    ~56 us per token per sequence in StopMatcher.push on the scheduler thread (7 us with 8), 256 KiB per choice
    frame (16 MiB for n=64). Continue's 12-17 short strings need nothing like it: bound the total."""
    _prepare(["<fim_prefix>", "\n\n", "```"] * 5)  # Continue-like: served
    with pytest.raises(BadRequest):
        _prepare(["x" * (MAX_STOP_CHARS - 3) + f"{i:03d}" for i in range(MAX_STOP_STRINGS)])


def test_the_admin_api_being_off_is_said_at_start(caplog: pytest.LogCaptureFixture) -> None:
    """An operator whose gateway on 0.0.0.0 used the admin API without keys learns of it only at the first 403."""
    from gateway.app import create_app

    with caplog.at_level(logging.WARNING):
        create_app(GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",), host="0.0.0.0"))
    assert any("admin" in r.getMessage().lower() for r in caplog.records), caplog.records


def test_the_admin_off_refusal_names_every_way_out() -> None:
    """The 403 names the key flags but not the other way: binding to loopback (or an explicit opt-in)."""
    from gateway.app import create_app

    app = create_app(GatewayConfig(prefill=("pd://127.0.0.1:1",), decode=("pd://127.0.0.1:2",), host="0.0.0.0"))
    refusal = app.app.refusal("/workers", [])
    assert refusal is not None and refusal[0] == 403
    assert b"127.0.0.1" in refusal[1] or b"loopback" in refusal[1], refusal[1]


def test_a_workers_metrics_stay_scrapable_with_its_api_key() -> None:
    """pd-cluster --host 0.0.0.0 now gives its workers a random --api-key it never shows: their /metrics (which a
    Prometheus scraped before) turns 401, while the gateway's /metrics stays open unless --metrics-require-admin."""
    from workers.http_app import create_http_app

    worker = SimpleNamespace(worker_id="p", started=True, scheduler=SimpleNamespace(is_alive=True, stalled_s=0.0),
                             kv=None, sglang=None, registration_error=None, info=lambda: {},
                             config=SimpleNamespace(role="prefill", engine="sim", transfer="tcp", api_key="k",
                                                    watchdog_timeout_s=300.0))
    # (the stand-in worker has no figures to collect: past the key, /metrics fails on them, a 500, not a 401)
    with TestClient(create_http_app(worker), raise_server_exceptions=False) as c:  # type: ignore[arg-type]
        assert c.get("/metrics").status_code != 401
        assert c.get("/stats").status_code == 401
