"""The benchmark's fast worker (``loadtests/fast_worker.py``) is a worker the real gateway accepts: a
prefill and a decode of it behind a real gateway answer chat completions, whole and streamed."""

from __future__ import annotations

import time

import openai
from pdtest import Procs, free_port, start_gateway


def start_fast_worker(procs: Procs, role: str, *extra: str) -> str:
    port = free_port()
    name = f"fast-{role}-{port}"
    proc = procs.start(name, "loadtests/fast_worker.py", "--role", role, "--port", str(port), *extra)
    deadline = time.monotonic() + 20
    while "fast_worker ready" not in procs.log(name):
        assert proc.poll() is None, f"fast worker exited: {procs.log(name)}"
        assert time.monotonic() < deadline, f"fast worker did not start: {procs.log(name)}"
        time.sleep(0.05)
    return f"pd://127.0.0.1:{port}"


def test_gateway_over_fast_workers_whole_and_streamed(procs: Procs) -> None:
    prefill = start_fast_worker(procs, "prefill")
    decode = start_fast_worker(procs, "decode", "--token-gap-ms", "1")
    port = start_gateway(procs, "--prefill", prefill, "--decode", decode)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=10)
    messages: list = [{"role": "user", "content": "How fast is the gateway?"}]

    out = client.chat.completions.create(model="sim", messages=messages, max_tokens=12)
    assert out.choices[0].message.content == "abcdefghijkl"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 12

    stream = client.chat.completions.create(model="sim", messages=messages, max_tokens=40, stream=True)
    texts, finish = [], None
    for chunk in stream:
        if chunk.choices:
            texts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    text = "".join(texts)
    assert len(text) == 40 and text.startswith("abcdefghijklmnopqrstuvwxyzabcd")
    assert finish == "length"
    assert len([t for t in texts if t]) > 1, "one token per tick: the stream arrives in several events"


def test_the_wakeup_probe_reports_round_trips() -> None:
    """``loadtests/wakeup_probe.py`` (the machine figure ``bench_stack.py`` prints with its latencies):
    real ping-pongs between two processes, percentiles in order, or None where cores 0 and 1 are not ours."""
    import json
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "loadtests/wakeup_probe.py", "--json", "--rounds", "200"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    figures = json.loads(out.stdout)
    assert set(figures) == {"same_core", "cross_core"}
    if not {0, 1} <= os.sched_getaffinity(0):
        assert figures == {"same_core": None, "cross_core": None}
        return
    for f in figures.values():
        assert 0 < f["p50_us"] <= f["p90_us"] <= f["p99_us"] < 10_000_000
