"""A stored response's id is the only thing that guards it on a gateway without keys (``GET /v1/responses/{id}``
answers whoever names it): it must not be computable from the ids the gateway hands every client.

The attack: one client collects the ids it is answered (its own responses' ids, the ``x-request-id`` the gateway
made for it), and, were they drawn from a Mersenne Twister (``random``), 624 of their 32-bit words give its whole
state, so the next ids the gateway draws (another client's response) are known in advance, and that client's
stored conversation can be read. Real processes: a gateway over one combined sim worker (no bootstrap rooms drawn
between the ids)."""

from __future__ import annotations

import random

import httpx
from pdtest import Procs, start_gateway, start_worker

FAST_SIM = tuple(f"--engine-option={k}=0" for k in ("verify_kv", "prefill_token_s", "decode_step_s", "decode_seq_s"))


def _untemper(y: int) -> int:
    y ^= y >> 18
    y ^= (y << 15) & 0xEFC60000
    x = y
    for _ in range(5):  # (y ^= (y << 7) & 0x9D2C5680, undone 7 bits at a time)
        x = y ^ ((x << 7) & 0x9D2C5680)
    y = x
    x = y
    for _ in range(3):  # (y ^= y >> 11)
        x = y ^ (x >> 11)
    return x & 0xFFFFFFFF


def _words(hex128: str) -> list[int]:
    """The four 32-bit outputs behind ``getrandbits(128)``'s 32 hex digits, in the order they were drawn (least
    significant first)."""
    value = int(hex128, 16)
    return [(value >> (32 * i)) & 0xFFFFFFFF for i in range(4)]


def test_response_ids_cannot_be_predicted_from_ids_a_client_was_given(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "256", "--page-size", "4", *FAST_SIM)
    base = f"http://127.0.0.1:{start_gateway(procs, '--worker', worker.url)}"
    with httpx.Client(base_url=base, timeout=30) as mallory:
        # 1. mallory's own requests, one after another: each draws the request id (answered as x-request-id), then
        # the response id (the answer's id)
        words: list[int] = []
        while len(words) < 624:
            r = mallory.post("/v1/responses", json={"model": "default", "input": "hi", "max_output_tokens": 1,
                                                    "store": False})
            assert r.status_code == 200, r.text
            words += _words(r.headers["x-request-id"]) + _words(r.json()["id"].removeprefix("resp_"))
        twin = random.Random()
        twin.setstate((3, (*[_untemper(w) for w in words[:624]], 624), None))
        for _ in range(len(words) - 624):  # (what was drawn past the first 624 words)
            twin.getrandbits(32)
        guesses = [f"resp_{twin.getrandbits(128):032x}" for _ in range(8)]

        # 2. alice stores a conversation
        with httpx.Client(base_url=base, timeout=30) as alice:
            r = alice.post("/v1/responses", json={"model": "default", "input": "my secret: 1234",
                                                  "max_output_tokens": 2})
            assert r.status_code == 200 and r.json()["store"] is True, r.text
            secret_id = r.json()["id"]

        # 3. mallory reads it by the id it computed (with its own request ids: it draws none of the gateway's)
        found = [g for g in guesses if mallory.get(f"/v1/responses/{g}", headers={"x-request-id": "m"}).status_code
                 == 200]
        assert secret_id not in guesses and not found, (
            f"alice's response id {secret_id} was computed from the ids mallory was answered: {found}")
