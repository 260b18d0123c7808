"""An SGLang decode whose stream breaks off after its head is counted in ``pd_gateway_worker_failures_total``
as ``worker_gone`` (its answer broken off), as the native path counts a decode lost mid-stream and as
docs/operations.md says, not as ``internal`` (an error status of the worker's own: it sent a 200)."""

from __future__ import annotations

from pathlib import Path

import httpx
from pdtest import Procs, start_gateway
from test_sglang_worker_failures_metric import samples, start_standin, total


def test_a_stream_broken_off_counts_worker_gone(procs: Procs, tmp_path: Path) -> None:
    prefill = start_standin(procs, "prefill", tmp_path / "p.jsonl")
    decode = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", prefill, "--decode", decode, "--max-retries", "0",
                         "--breaker-failures", "3", "--breaker-cooldown-s", "60")
    url = f"http://127.0.0.1:{port}/generate"
    with httpx.stream("POST", url, json={"text": "DECODE_BREAKS", "stream": True}, timeout=30) as reply:
        assert reply.status_code == 200  # (the head went out before the decode broke off)
        body = reply.read()
    assert b"error" in body, body
    assert total(port, "pd_gateway_worker_failures_total", worker=decode, role="decode") == 1, \
        samples(port, "pd_gateway_worker_failures_total")
    assert total(port, "pd_gateway_worker_failures_total", worker=decode, role="decode", code="worker_gone") == 1, \
        samples(port, "pd_gateway_worker_failures_total")
