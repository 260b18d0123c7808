"""logit_bias, presence/frequency/repetition penalties and min_tokens through real gateways and workers.

Sim workers: min_tokens is honoured, what needs logits is refused by name, bad values are 400s naming the
field, and every KV page comes back. SmolLM2 (slow): greedy requests with the fields give the same
tokens through prefill -> decode as on one ``--role both`` worker, and the fields visibly act.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from pdtest import Procs, SmolDeployment, start_smollm2, wait_pools_full

from workers.engines.sim import ALPHABET

MESSAGES = [{"role": "user", "content": "Say hello."}]
STOPS = sorted(set(ALPHABET))  # every token the sim emits


def _client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


def test_sim_honours_min_tokens(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = _client(cluster.base_url)
    plain = c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=16,  # type: ignore[arg-type]
                                      extra_body={"stop_token_ids": STOPS})
    assert plain.usage and plain.usage.completion_tokens == 1 and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == ""  # the stop token's text is left out (vLLM, SGLang)
    held = c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=16,  # type: ignore[arg-type]
                                     extra_body={"stop_token_ids": STOPS, "min_tokens": 5})
    # outputs 0-4 (the first sampled on the prefill) are forced off the stop ids; output 5 is the sim's own
    assert held.usage and held.usage.completion_tokens == 6 and held.choices[0].finish_reason == "stop"
    assert len(held.choices[0].message.content or "") == 5  # (one character per sim token)
    kept = c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=16,  # type: ignore[arg-type]
                                     extra_body={"stop_token_ids": STOPS, "min_tokens": 5,
                                                 "include_stop_str_in_output": True})
    kept_text = kept.choices[0].message.content or ""  # the stop token's text kept, when asked
    assert len(kept_text) == 6 and kept_text.startswith(held.choices[0].message.content or ""), kept
    streamed = c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=16, stream=True,  # type: ignore[arg-type]
                                         extra_body={"stop_token_ids": STOPS, "min_tokens": 5})
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == \
        held.choices[0].message.content
    r = httpx.post(f"{cluster.base_url}/generate", timeout=30, json={
        "text": "Say hello.", "sampling_params": {"max_new_tokens": 16, "stop_token_ids": STOPS,
                                                  "min_new_tokens": 3}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4 and r.json()["meta_info"]["finish_reason"]["type"] == "stop"
    generated = r.json()
    assert len(generated["text"]) == 3  # (SGLang trims the matched stop token's text too)
    assert generated["meta_info"]["finish_reason"]["matched"] == generated["output_ids"][-1]

    # Stop strings too count only after min_tokens (as vLLM): a character the answer has before its 5th
    # token and again later ends it at the later one (the sim's tokens are one character each).
    text = c.completions.create(model="sim", prompt="Say hello.", max_tokens=40).choices[0].text
    stop = next(ch for ch in text[:5] if text.find(ch, 5) >= 0)
    for stream in (False, True):
        out = c.completions.create(model="sim", prompt="Say hello.", max_tokens=40, stop=[stop], stream=stream,
                                   extra_body={"min_tokens": 5})
        got = "".join(ch.choices[0].text for ch in out if ch.choices) if stream else out.choices[0].text
        assert got == text[:text.find(stop, 5)], (stream, stop, text, got)
    whole = c.completions.create(model="sim", prompt="Say hello.", max_tokens=40, stop=[stop],
                                 extra_body={"min_tokens": 5})
    assert whole.usage and whole.usage.completion_tokens == text.find(stop, 5) + 1  # the decode stopped there
    cluster.wait_pools_full()


async def _streams(base_url: str, body: dict[str, Any], n: int, kill_pid: int) -> list[dict[str, Any]]:
    """``n`` concurrent streams of ``body``; once every one has text, SIGKILL ``kill_pid`` (a decode)."""
    progress = [0] * n

    async def one(client: httpx.AsyncClient, index: int) -> dict[str, Any]:
        out: dict[str, Any] = {"text": "", "usage": None, "error": None}
        async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                                   "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                out["error"] = event.get("error", out["error"])
                out["usage"] = event.get("usage") or out["usage"]
                out["text"] += "".join(c["text"] for c in event.get("choices", []))
                progress[index] = len(out["text"])
        return out

    async with httpx.AsyncClient(base_url=base_url, timeout=60) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        deadline = time.monotonic() + 30
        while min(progress) < 2:
            assert time.monotonic() < deadline, progress
            await asyncio.sleep(0.02)
        os.kill(kill_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_a_migrated_stream_counts_its_earlier_outputs_for_min_tokens(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """A stream moved to a new pair mid-way (its outputs so far now part of the prompt, output_offset k) stops
    where it would have: min_tokens counts the k outputs it already had, not from zero again."""
    cluster = sim_cluster(num_prefill=2, num_decode=2, decode_args=("--engine-option", "decode_step_s=0.03"))
    body = {"model": "sim", "prompt": "A stream that outlives its decode.", "max_tokens": 60, "min_tokens": 24,
            "stop_token_ids": STOPS}
    results = asyncio.run(_streams(cluster.base_url, body, 8, cluster.decodes[0].proc.pid))
    want = httpx.post(f"{cluster.base_url}/v1/completions", json=body, timeout=60).json()
    assert want["usage"]["completion_tokens"] == 25, want  # 24 held off the stops, the 25th is the sim's own
    for out in results:
        assert out["error"] is None, out
        assert out["text"] == want["choices"][0]["text"] and out["usage"]["completion_tokens"] == 25, out
    migrations = httpx.get(f"{cluster.base_url}/metrics", timeout=10).text
    assert any(line.startswith("pd_gateway_migrations_total ") and float(line.split()[-1]) >= 1
               for line in migrations.splitlines()), "some streams moved (else this test could not fail)"
    cluster.wait_pools_full(alive_only=True)


REFUSED_BY_SIM: list[tuple[dict[str, Any], str]] = [
    ({"logit_bias": {"65": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -0.5}, "frequency_penalty"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
]


def test_sim_refuses_what_needs_logits_by_name(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = _client(cluster.base_url)
    for kwargs, field in REFUSED_BY_SIM:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4, stream=stream,  # type: ignore[call-overload]
                                          **kwargs)
            err = info.value.response.json()["error"]
            assert f"{field} is not supported by the sim engine" in err["message"], err
            assert err["param"] == field, err
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="sim", prompt="Once upon a time", max_tokens=4, **kwargs)
        assert info.value.response.json()["error"]["param"] == field
        r = httpx.post(f"{cluster.base_url}/generate", timeout=30, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 4, **kwargs.get("extra_body", kwargs)}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == f"sampling_params.{field}", r.text
    cluster.wait_pools_full()


BAD_VALUES: list[tuple[str, dict[str, Any], str]] = [
    ("chat", {"presence_penalty": 2.5}, "presence_penalty"),
    ("chat", {"frequency_penalty": -2.01}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"repetition_penalty": -1.0}, "repetition_penalty"),
    ("chat", {"logit_bias": {"65": 100.5}}, "logit_bias"),
    ("chat", {"logit_bias": {"sixty-five": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"-3": 1}}, "logit_bias"),
    ("chat", {"logit_bias": [65]}, "logit_bias"),
    ("chat", {"min_tokens": -1}, "min_tokens"),
    ("chat", {"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ("completions", {"presence_penalty": "high"}, "presence_penalty"),
    ("completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ("generate", {"presence_penalty": 3}, "sampling_params.presence_penalty"),
    ("generate", {"repetition_penalty": 0.0}, "sampling_params.repetition_penalty"),
    ("generate", {"logit_bias": {"1": -101}}, "sampling_params.logit_bias"),
    ("generate", {"min_new_tokens": 9, "max_new_tokens": 8}, "sampling_params.min_new_tokens"),
]


def test_bad_values_are_a_400_naming_the_field(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    for route, fields, param in BAD_VALUES:
        if route == "generate":
            body: dict[str, Any] = {"text": "hi", "sampling_params": {"max_new_tokens": 4, **fields}}
            url = f"{cluster.base_url}/generate"
        elif route == "chat":
            body, url = {"messages": MESSAGES, "max_tokens": 4, **fields}, f"{cluster.base_url}/v1/chat/completions"
        else:
            body, url = {"prompt": "hi", "max_tokens": 4, **fields}, f"{cluster.base_url}/v1/completions"
        r = httpx.post(url, json=body, timeout=30)
        assert r.status_code == 400, (fields, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (fields, err)
    cluster.wait_pools_full()


# -- SmolLM2 through prefill -> decode and on one combined worker ------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolDeployment]:
    procs = Procs(tmp_path_factory.mktemp("sampling-surface"))
    try:
        yield start_smollm2(procs, chunk_size=32)
    finally:
        procs.stop_all()


def _generate(base_url: str, question: str = "List some fruits.", **sampling: Any) -> dict[str, Any]:
    body = {"text": f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, **sampling}}
    r = httpx.post(f"{base_url}/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


PENALTIES = {"presence_penalty": 1.0, "frequency_penalty": 0.8, "repetition_penalty": 1.3}


@pytest.mark.slow
def test_penalties_through_the_split_equal_one_worker_and_change_the_output(smollm2: SmolDeployment) -> None:
    plain = _generate(smollm2.pd_url)["output_ids"]
    for sampling in ({"repetition_penalty": 1.3}, {"presence_penalty": 1.5, "frequency_penalty": 1.0}, PENALTIES):
        pd = _generate(smollm2.pd_url, **sampling)["output_ids"]
        assert pd == _generate(smollm2.both_url, **sampling)["output_ids"], sampling
        assert pd != plain, f"{sampling} changes a 24-token greedy answer that repeats tokens"
    chat_kw: dict[str, Any] = {"model": "default", "max_tokens": 20, "temperature": 0, "presence_penalty": 0.8,
                               "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.2},
                               "messages": [{"role": "user", "content": "Write one sentence about the sea."}]}
    pd_chat = _client(smollm2.pd_url).chat.completions.create(**chat_kw)
    both_chat = _client(smollm2.both_url).chat.completions.create(**chat_kw)
    assert pd_chat.choices[0].message.content == both_chat.choices[0].message.content
    stream = _client(smollm2.pd_url).chat.completions.create(**chat_kw, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == \
        pd_chat.choices[0].message.content
    seeded = {**PENALTIES, "temperature": 0.9, "sampling_seed": 7, "logit_bias": {"30": 2.0}, "min_new_tokens": 12}
    assert _generate(smollm2.pd_url, **seeded)["output_ids"] == _generate(smollm2.both_url, **seeded)["output_ids"]


@pytest.mark.slow
def test_logit_bias_forces_and_bans_tokens(smollm2: SmolDeployment) -> None:
    plain = _generate(smollm2.pd_url)["output_ids"]
    forced_id = 9690  # a token the plain answer does not use
    assert forced_id not in plain
    forced = _generate(smollm2.pd_url, max_new_tokens=6, logit_bias={str(forced_id): 100})["output_ids"]
    assert forced == [forced_id] * 6, "a +100 bias wins every greedy step, the prefill's first token too"
    banned = {str(t): -100 for t in plain[:3]}
    pd = _generate(smollm2.pd_url, logit_bias=banned)["output_ids"]
    assert not set(pd) & set(plain[:3])
    assert pd == _generate(smollm2.both_url, logit_bias=banned)["output_ids"]
    c = _client(smollm2.pd_url)
    out = c.completions.create(model="default", prompt="The capital of France is", max_tokens=4, temperature=0,
                               logit_bias={str(forced_id): 100})
    both = _client(smollm2.both_url).completions.create(model="default", prompt="The capital of France is",
                                                         max_tokens=4, temperature=0, logit_bias={str(forced_id): 100})
    assert out.choices[0].text == both.choices[0].text and out.usage and out.usage.completion_tokens == 4


@pytest.mark.slow
def test_min_tokens_holds_back_the_end_of_sequence(smollm2: SmolDeployment) -> None:
    question = "What is the capital of France?"
    short = _generate(smollm2.pd_url, question, max_new_tokens=64)
    n = len(short["output_ids"])
    assert short["meta_info"]["finish_reason"]["type"] == "stop" and n < 40, "the plain answer ends with EOS"
    held = _generate(smollm2.pd_url, question, max_new_tokens=64, min_new_tokens=n + 8)
    assert len(held["output_ids"]) >= n + 8
    assert held["output_ids"] == _generate(smollm2.both_url, question, max_new_tokens=64,
                                           min_new_tokens=n + 8)["output_ids"]
    # EOS (id 2) pushed up by +100 is still banned while min_new_tokens holds: on the first token, which the
    # prefill samples, and on the decode's
    first = _generate(smollm2.pd_url, max_new_tokens=4, min_new_tokens=4, logit_bias={"2": 100})
    assert 2 not in first["output_ids"] and len(first["output_ids"]) == 4


@pytest.mark.slow
def test_a_token_outside_the_vocabulary_is_a_400_and_pools_are_full(smollm2: SmolDeployment) -> None:
    for url in (smollm2.pd_url, smollm2.both_url):
        r = httpx.post(f"{url}/v1/completions", timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2, "logit_bias": {"49152": 1}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias" and "vocabulary" in r.json()["error"]["message"]
    wait_pools_full(smollm2.workers, 30)
