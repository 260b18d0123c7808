"""Requests popular clients send by default, which vLLM and SGLang serve (review: client compatibility).

- Continue's autocomplete sends its FIM template's stop strings plus five of its own (``getStopTokens``):
  12 for its default template, 14 for Qwen-coder's; it cuts the list to 4 only for api.openai.com, Groq and
  Azure (``getMaxStopWords``: unlimited for any other host). vLLM and SGLang take any number.
- Continue's ``vllm`` provider (model AUTODETECT) reads ``max_model_len`` from ``GET /v1/models`` as the context
  length (vLLM and SGLang list it); without it the length is ``parseInt(undefined)``: NaN.
- A gzip-encoded body is not decoded (nor by vLLM's or SGLang's FastAPI): a 415 that says why, not a 400
  "not valid JSON".
"""

from __future__ import annotations

import gzip
import json
from typing import Any

import httpx

CONTINUE_OWN_STOPS = ["\n\n", "\r\n\r\n", "/src/", "#- coding: utf-8", "```"]
CONTINUE_DEFAULT_STOPS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>",
                          "</fim_middle>", "</code>", *CONTINUE_OWN_STOPS]
CONTINUE_QWEN_STOPS = ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                       "<|repo_name|>", "<|file_sep|>", "<|im_start|>", "<|im_end|>", *CONTINUE_OWN_STOPS]


def test_continue_autocomplete_stop_lists_are_served(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        for stops in (CONTINUE_DEFAULT_STOPS, CONTINUE_QWEN_STOPS):
            prompt = "<fim_prefix>def f():\n    <fim_suffix>\n<fim_middle>"
            body: dict[str, Any] = {"model": "default", "prompt": prompt,
                                    "max_tokens": 8, "temperature": 0.01, "stream": True, "stop": stops}
            r = http.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert r.text.rstrip().endswith("data: [DONE]"), r.text
            r = http.post("/v1/chat/completions", json={"model": "default", "max_tokens": 8, "stop": stops,
                                                        "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            r = http.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 4, "stop": stops}})
            assert r.status_code == 200, r.text


def test_models_list_has_max_model_len(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        card = http.get("/v1/models").json()["data"][0]
        assert isinstance(card.get("max_model_len"), int) and card["max_model_len"] > 0, card
        assert http.get(f"/v1/models/{card['id']}").json().get("max_model_len") == card["max_model_len"]
        # The decode's KV pool (256 pages of 4 tokens) holds less than the model's context (8192): what a client
        # sizing its requests by max_model_len sends is served, one token more is not.
        assert card["max_model_len"] == 1024, card
        body = {"model": "default", "prompt": "hi", "max_tokens": 1, "temperature": 0}
        prompt = http.post("/v1/completions", json=body).json()["usage"]["prompt_tokens"]
        r = http.post("/v1/completions", json={**body, "max_tokens": card["max_model_len"] - prompt})
        assert r.status_code == 200, r.text
        r = http.post("/v1/completions", json={**body, "max_tokens": card["max_model_len"] - prompt + 1})
        assert r.status_code == 400, r.text


def test_a_compressed_body_is_a_415_naming_its_encoding(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    body = json.dumps({"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    with httpx.Client(base_url=cluster.base_url, timeout=60) as http:
        r = http.post("/v1/chat/completions", content=gzip.compress(body.encode()),
                      headers={"content-type": "application/json", "content-encoding": "gzip"})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_content_encoding", r.text
        assert "content-encoding" in r.json()["error"]["message"].lower(), r.text
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], r.text  # (plain: as before)
