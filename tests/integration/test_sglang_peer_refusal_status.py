"""A request one side of a PD pair refuses (its pool is too small for it), driven as SGLang's router drives our
workers: the same body POSTed to the prefill and the decode with the bootstrap fields. The refusing side answers
400 and ends the room on the other; the other side answered 502 (``transfer_failed``), which SGLang's router (and
our gateway's relay) retries and holds against that healthy worker's circuit breaker: two such requests opened
it and every client got 503. The other side answers the refusal's 400 too (a stream: 200 and an error event, as
SGLang's server answers a refused stream)."""

from __future__ import annotations

import json
import random

import httpx
import pytest
from pdtest import Procs, free_port, post_to_pair, start_worker, wait_pools_full

SIM = ("--engine", "sim", "--page-size", "4")


def both(prefill: int, decode: int, body: dict[str, object], stream: bool) -> dict[str, httpx.Response]:
    """SGLang's router: the same body to both at once, with a fresh room and the prefill's registry."""
    return post_to_pair(prefill, decode, "generate", {**body, "stream": stream,
                                                      "bootstrap_room": random.randrange(2**63)}, 30)


def refused(reply: httpx.Response, stream: bool) -> str:
    """The error message of a refusal as SGLang's server answers it (else an assertion error)."""
    if not stream:
        assert reply.status_code == 400, (reply.status_code, reply.text)
        return reply.json()["error"]["message"]
    assert reply.status_code == 200, (reply.status_code, reply.text)
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", reply.text
    return json.loads(events[0])["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_other_side_of_a_refused_request_answers_the_refusal(procs: Procs, stream: bool) -> None:
    registry = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--num-pages", "16", "--bootstrap-embedded", str(registry))
    decode = start_worker(procs, "decode", *SIM, "--num-pages", "64")
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": registry}
    cases = {
        "prefill": {"text": "x" * 100, "sampling_params": {"max_new_tokens": 4}},  # 25 pages: the prefill has 16
        "decode": {"text": "short", "sampling_params": {"max_new_tokens": 500}},  # 127 pages: the decode has 64
    }
    for refuser, body in cases.items():
        replies = both(prefill.http_port, decode.http_port, {**body, **fields}, stream)
        other = "decode" if refuser == "prefill" else "prefill"
        assert "KV pages" in refused(replies[refuser], stream)
        assert "KV pages" in refused(replies[other], stream), f"the {other} answered the {refuser}'s refusal so"
    wait_pools_full([prefill, decode], 10)
