"""Batched completions prompts (a list of strings or of token-id lists, as OpenAI's legacy API and
vLLM take them, and as lm-evaluation-harness sends them with a batch size above 1): each prompt runs
``n`` times, choice ``i * n + j`` is prompt ``i``'s ``j``-th, and the usage counts each prompt once."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

PROMPTS = ["Once upon a time", "The quick brown fox", "Lorem ipsum"]


def client(cluster: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_a_batch_answers_each_prompt_as_alone(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    alone = [c.completions.create(model="sim", prompt=p, max_tokens=6, temperature=0, echo=True, logprobs=1)
             for p in PROMPTS]
    batch = c.completions.create(model="sim", prompt=PROMPTS, max_tokens=6, temperature=0, n=2, echo=True,
                                 logprobs=1)
    assert [ch.index for ch in batch.choices] == list(range(6))
    for i, single in enumerate(alone):
        for j in range(2):
            choice = batch.choices[i * 2 + j]
            assert choice.text == single.choices[0].text and choice.text.startswith(PROMPTS[i])
            assert choice.logprobs and single.choices[0].logprobs
            assert choice.logprobs.tokens == single.choices[0].logprobs.tokens
            assert choice.logprobs.text_offset == single.choices[0].logprobs.text_offset
    assert batch.usage and all(s.usage for s in alone)
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in alone)  # type: ignore[union-attr]
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in alone)  # type: ignore[union-attr]

    ids = [[72, 105, 33], [79, 107]]
    by_ids = c.completions.create(model="sim", prompt=ids, max_tokens=4, temperature=0)
    assert [ch.text for ch in by_ids.choices] == [
        c.completions.create(model="sim", prompt=p, max_tokens=4, temperature=0).choices[0].text for p in ids]
    assert by_ids.usage and by_ids.usage.prompt_tokens == 5

    # streamed: every choice's chunks joined are the whole response's text (the echoed prompt first)
    texts: dict[int, str] = {}
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", timeout=60, json={
            "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2, "echo": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {ch.index: ch.text for ch in batch.choices}

    # Cached prompt tokens: each prompt's once (its choices share it), all the batch's prompts together.
    long = [p * 8 for p in PROMPTS[:2]]
    for p in long:
        c.completions.create(model="sim", prompt=p, max_tokens=2, temperature=0)  # (now in the prefix cache)
    cached = [c.completions.create(model="sim", prompt=p, max_tokens=2, temperature=0).usage for p in long]
    again = c.completions.create(model="sim", prompt=long, max_tokens=2, temperature=0, n=2).usage
    assert all(u and u.prompt_tokens_details and u.prompt_tokens_details.cached_tokens for u in cached)
    assert again and again.prompt_tokens_details
    assert again.prompt_tokens_details.cached_tokens == sum(
        u.prompt_tokens_details.cached_tokens for u in cached)  # type: ignore[union-attr]
    cluster.wait_pools_full()


@pytest.mark.parametrize(("prompt", "param"), [
    (["a prompt", 5], "prompt[1]"),
    ([[1, 2], [-1]], "prompt[1]"),
    (["x"] * 65, "prompt"),
])
def test_a_bad_batch_is_a_400_naming_the_prompt(sim_cluster, prompt: Any, param: str) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": ["x"] * 33, "n": 2, "max_tokens": 4},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "x", "n": 65, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


def test_up_to_64_choices_of_one_prompt(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "many"}], "n": 64, "max_tokens": 3, "seed": 1})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(64)) and all(c["message"]["content"] for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 64 * 3
    cluster.wait_pools_full()
