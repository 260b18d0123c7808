"""A stream migrated between fast workers (``loadtests/fast_worker.py``) goes on at its true output position
(``SamplingParams.output_offset``), as a sim or torch decode does: the text is the unfailed run's, with no
letter repeated from the start of the alphabet."""

from __future__ import annotations

import json

import httpx
from pdtest import Procs, start_gateway
from test_fast_worker import start_fast_worker


def test_a_stream_migrated_off_a_killed_fast_decode_continues_its_letters(procs: Procs) -> None:
    prefill = start_fast_worker(procs, "prefill")
    decodes = {}
    for _ in range(2):
        url = start_fast_worker(procs, "decode", "--token-gap-ms", "20")
        decodes[url] = procs.procs[-1]
    port = start_gateway(procs, "--prefill", prefill, "--decode", *decodes)
    base = f"http://127.0.0.1:{port}"
    body = {"model": "sim", "prompt": "hi", "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True}}
    text, usage, killed = "", None, []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=30) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            text += "".join(choice["text"] for choice in event["choices"])
            if len(text) >= 10 and not killed:  # the decode serving the stream dies mid-way
                workers = httpx.get(f"{base}/health", timeout=5).json()["workers"]
                (busy,) = [w["url"] for w in workers if w["role"] == "decode" and w["active"]]
                decodes[busy].kill()
                killed.append(busy)
    assert killed, "the stream ended before its decode could be killed"
    assert text == "abcdefghijklmnopqrstuvwxyzabcdefghijklmn", "no letter repeated, none missing"
    assert usage is not None and usage["completion_tokens"] == 40
