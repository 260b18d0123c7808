"""SGLang's PD router answers ``GET /v1/models`` from its first prefill worker: a prefill worker's own SGLang API
must then give a ``max_model_len`` that its KV pool holds the prompt of (the gateway bounds it by the prefills'
pools: ``test_max_model_len_prefill_pool.py``). It gave the context (8,192) over a pool of 256 tokens: a client
sizing its request by it (a prompt of ``max_model_len - 1`` tokens, one to generate) got a 400 from the prefill."""

from __future__ import annotations

import random

import httpx
from pdtest import Procs, free_port, post_to_pair, start_worker

PAGES = ("--engine", "sim", "--page-size", "4")


def test_a_prefill_workers_max_model_len_fits_its_pool(procs: Procs) -> None:
    registry = free_port()
    prefill = start_worker(procs, "prefill", *PAGES, "--num-pages", "64", "--bootstrap-embedded", str(registry))
    decode = start_worker(procs, "decode", *PAGES, "--num-pages", "1024")
    card = httpx.get(f"http://127.0.0.1:{prefill.http_port}/v1/models", timeout=30).json()["data"][0]
    limit = card["max_model_len"]
    assert limit <= 256 + 1, card  # (the longest prompt its 64 pages of 4 tokens hold, and one token to generate)
    body = {"input_ids": [65] * (limit - 1), "sampling_params": {"max_new_tokens": 1, "ignore_eos": True},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": registry, "bootstrap_room": random.randrange(2**63)}
    replies = post_to_pair(prefill.http_port, decode.http_port, "generate", body)
    for side in ("prefill", "decode"):
        assert replies[side].status_code == 200, (side, replies[side].text)
