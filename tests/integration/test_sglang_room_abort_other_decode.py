"""A room number used by two requests at once (clients of our workers' SGLang API choose ``bootstrap_room``
themselves), each sent to a different decode with the same prefill; the second decode refuses its request and
tells the prefill (``Abort``). One client's refused request killed the other's live one:
- the abort after the live decode's page list: the prefill dropped that page list (waiting for the prefill's own
  request) and buried the room, so that the live request failed at once when its prefill part came, and its
  decode waited for KV that never came;
- the abort before it: the prefill buried the room for that abort, refused the live decode's page list ("already
  aborted") and failed the live request's prefill part at once, for as long as the room's tombstone lived
  (``--bootstrap-timeout-s``).
A decode's abort ends the room for that decode only: another decode's page list for it is taken as the room's."""

from __future__ import annotations

import random
import threading
import time

import httpx
import pytest
from pdtest import Procs, Worker, free_port, start_worker, wait_pools_full

SIM = ("--engine", "sim", "--page-size", "4")


def load(worker: Worker) -> dict[str, int]:
    got = worker.get("/load")
    assert isinstance(got, dict)
    return got


@pytest.mark.parametrize("refused_first", [False, True], ids=["abort-after-page-list", "abort-before-page-list"])
def test_a_decline_from_another_decode_leaves_a_live_room_alone(procs: Procs, refused_first: bool) -> None:
    registry = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--num-pages", "64", "--bootstrap-embedded", str(registry))
    first = start_worker(procs, "decode", *SIM, "--num-pages", "64")
    other = start_worker(procs, "decode", *SIM, "--num-pages", "16")
    room = random.randrange(2**62)
    fields = {"bootstrap_host": "127.0.0.1", "bootstrap_port": registry, "bootstrap_room": room}
    body = {"text": "hello there, how are you", "sampling_params": {"max_new_tokens": 4}, **fields}
    replies: dict[str, httpx.Response] = {}

    def post(name: str, worker: Worker, data: dict[str, object]) -> None:
        replies[name] = httpx.post(f"http://127.0.0.1:{worker.http_port}/generate", json=data, timeout=30)

    def refused() -> None:
        """Another client's request with the room, to another decode, which refuses it (too long for its pool)
        and tells the prefill; its prefill part never comes."""
        post("refused", other, {**body, "sampling_params": {"max_new_tokens": 500}})
        assert replies["refused"].status_code == 400, replies["refused"].text
        time.sleep(1.0)  # (its Abort reaches the prefill)

    if refused_first:
        refused()
    # The live request's decode part first: its page list waits at the prefill for the prefill's part.
    decode_part = threading.Thread(target=post, args=("decode", first, body))
    decode_part.start()
    deadline = time.monotonic() + 10
    while not load(first).get("num_inflight_transfers") and decode_part.is_alive():  # (refused: it ends)
        assert time.monotonic() < deadline, load(first)
        time.sleep(0.05)
    time.sleep(0.5)  # (its page list on its way to the prefill)
    if not refused_first:
        refused()
    post("prefill", prefill, body)
    decode_part.join()
    assert replies["prefill"].status_code == 200, replies["prefill"].text
    assert replies["decode"].status_code == 200, replies["decode"].text
    assert replies["decode"].json()["meta_info"]["completion_tokens"] == 4
    wait_pools_full([prefill, first, other], 10)
