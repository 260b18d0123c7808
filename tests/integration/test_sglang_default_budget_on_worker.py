"""A request without ``max_new_tokens`` / ``max_tokens``, driven as SGLang's router drives our workers (the same body to
the prefill and the decode, with the bootstrap fields): the default budget is cut to what the decode's KV pool holds,
as our gateway cuts it (``test_default_budget_fits_pool.py``) and as SGLang's scheduler does. The worker's own
SGLang API cut it to the context only: the decode refused a prompt its pool holds ("request needs 270 KV pages; the
pool has 256", a 400 for a field the client never sent), where the same request through our gateway is served."""

from __future__ import annotations

import random

from pdtest import Procs, free_port, post_to_pair, start_worker

SIM = ("--engine", "sim", "--page-size", "4", "--num-pages", "256")  # a pool of 1,024 tokens, a context of 8,192


def test_a_default_budget_is_cut_to_the_decodes_pool(procs: Procs) -> None:
    registry = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(registry))
    decode = start_worker(procs, "decode", *SIM)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": registry}
    for path, body, count in [
        ("generate", {"input_ids": [65] * 950, "sampling_params": {"ignore_eos": True}},
         lambda r: r["meta_info"]["completion_tokens"]),
        ("v1/completions", {"model": "sim", "prompt": [65] * 900, "ignore_eos": True},
         lambda r: r["usage"]["completion_tokens"]),
    ]:
        replies = post_to_pair(prefill.http_port, decode.http_port, path,
                       {**body, **fields, "bootstrap_room": random.randrange(2**63)})
        for side in ("prefill", "decode"):
            assert replies[side].status_code == 200, (path, side, replies[side].text)
        prompt = 950 if path == "generate" else 900
        assert 0 < count(replies["decode"].json()) <= 1024 - prompt, replies["decode"].text
