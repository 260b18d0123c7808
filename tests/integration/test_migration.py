"""Stream migration: a decode killed under 16 concurrent streams, real processes (sim engine, greedy).

With migration on (the default, ``--max-migrations 2``) every stream ends with ``[DONE]`` and exactly
the text it would have had without the failure (the sim's tokens are a function of the KV the
worker holds, so a wrong or missing piece of the resubmitted prompt changes them), usage counted
once. With ``--max-migrations 0`` the streams on the killed decode get a clear error event instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
from sim_reference import expected_tokens, text_of

PROMPT = [ord(c) for c in "A stream that outlives its decode worker."]
NUM_STREAMS = 16
MAX_TOKENS = 48
SLOW_DECODE = ("--engine-option", "decode_step_s=0.03")


async def stream_one(client: httpx.AsyncClient, started: asyncio.Event, progress: list[int], index: int) -> dict:  # type: ignore[type-arg]
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}}
    out: dict = {"text": "", "done": False, "error": None, "usage": None, "ids": set()}  # type: ignore[type-arg]
    async with client.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                break
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            out["ids"].add(event["id"])
            if event.get("usage"):
                out["usage"] = event["usage"]
            for choice in event["choices"]:
                out["text"] += choice["text"]
                progress[index] = len(out["text"])
                if len(out["text"]) >= 3:
                    started.set()
    return out


async def run_streams(base_url: str, kill: int) -> list[dict]:  # type: ignore[type-arg]
    progress = [0] * NUM_STREAMS
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream_one(client, started, progress, i)) for i in range(NUM_STREAMS)]
        deadline = time.monotonic() + 30
        while min(progress) < 3:  # every stream under way on its decode
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.02)
        assert max(progress) < MAX_TOKENS, "streams must still be running when the decode dies"
        os.kill(kill, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.split(" ")[0] == name)


def test_streams_migrate_off_a_killed_decode_with_the_same_text(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=2, num_decode=2, decode_args=SLOW_DECODE)
    want = text_of(expected_tokens(PROMPT, MAX_TOKENS))
    results = asyncio.run(run_streams(cluster.base_url, cluster.decodes[0].proc.pid))
    for out in results:
        assert out["error"] is None and out["done"], out
        assert out["text"] == want, "no token lost, none repeated"
        assert len(out["ids"]) == 1, "one response id for the whole stream"
        usage = out["usage"]
        assert usage["completion_tokens"] == MAX_TOKENS and usage["prompt_tokens"] == len(PROMPT), usage
        # The client's cache hits are its prompt's: a migrated stream's new prompt (its prompt and the
        # tokens streamed so far) may hit more on the new pair, which is not the client's to see.
        assert usage["prompt_tokens_details"]["cached_tokens"] <= len(PROMPT), usage
    migrated = metric(cluster.base_url, "pd_gateway_migrations_total")
    assert 1 <= migrated <= NUM_STREAMS, "the streams on the killed decode moved, the others did not"
    assert metric(cluster.base_url, "pd_gateway_generation_tokens_total") == NUM_STREAMS * MAX_TOKENS
    cluster.wait_pools_full(alive_only=True)


def test_without_migration_the_killed_decodes_streams_get_an_error_event(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=2, num_decode=2, decode_args=SLOW_DECODE,
                          gateway_args=("--max-migrations", "0"))
    want = text_of(expected_tokens(PROMPT, MAX_TOKENS))
    results = asyncio.run(run_streams(cluster.base_url, cluster.decodes[0].proc.pid))
    failed = [out for out in results if out["error"] is not None]
    assert failed and len(failed) < NUM_STREAMS, "the streams on the killed decode, and only those, failed"
    for out in failed:
        assert out["error"]["type"] == "upstream_error" and out["done"], out  # a clear event, then [DONE]
        assert want.startswith(out["text"]) and len(out["text"]) < MAX_TOKENS
    for out in results:
        if out["error"] is None:
            assert out["text"] == want
    assert metric(cluster.base_url, "pd_gateway_migrations_total") == 0
    cluster.wait_pools_full(alive_only=True)
