"""The response store's memory is bounded in bytes (``--responses-store-max-mib``), not only in entries: a stored
response echoes fields of its request that never reach the prompt (a tool's unknown fields, ``user``, a format's
schema...), so the context does not bound it, and ``--responses-store-max`` (1000) full bodies (8 MiB each) would
be gigabytes held for a client that spent one output token on each. Real processes: a gateway over one combined
sim worker, its resident memory read from ``/proc``."""

from __future__ import annotations

import httpx
from pdtest import Procs, start_gateway, start_worker

FAST_SIM = tuple(f"--engine-option={k}=0" for k in ("verify_kv", "prefill_token_s", "decode_step_s", "decode_seq_s"))
MIB = 1024 * 1024


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_stored_responses_stay_within_the_byte_budget(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "256", "--page-size", "4", *FAST_SIM)
    port = start_gateway(procs, "--worker", worker.url, "--responses-store-max-mib", "16")
    gateway = next(p for p in procs.procs if p.name == f"gateway-{port}")
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        def respond(junk: str) -> httpx.Response:
            r = client.post("/v1/responses", json={
                "model": "default", "input": "hi", "max_output_tokens": 1,
                # (the prompt has the tool's name, description and parameters; the rest is only echoed)
                "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}, "x-notes": junk}]})
            assert r.status_code == 200 and r.json()["store"] is True, r.text
            return r

        respond("warm up")
        before = _rss_mib(gateway.pid)
        ids = [respond(chr(ord("a") + i) * (4 * MIB)).json()["id"] for i in range(24)]  # 96 MiB of echoed fields
        grown = _rss_mib(gateway.pid) - before
        assert grown < 64, f"the gateway holds {grown:.0f} MiB more after 24 stored responses of 4 MiB each"
        # the latest ones are kept (as answered), the oldest gone to make room
        latest = client.get(f"/v1/responses/{ids[-1]}")
        assert latest.status_code == 200 and latest.json()["tools"][0]["x-notes"] == "x" * (4 * MIB)
        assert client.get(f"/v1/responses/{ids[0]}").status_code == 404


def test_a_long_chain_is_prepared_off_the_loop_and_the_routes_methods(procs: Procs) -> None:
    """A continuation with a short body and a long stored conversation (prepared on a thread: the request's
    ``Pending`` goes with it) is stored; a method the route lacks is a 405 that allows all it has."""
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "8192", "--page-size", "4", *FAST_SIM)
    port = start_gateway(procs, "--worker", worker.url, "--prepare-thread-bytes", "4096")  # (the sim's context: 8192)
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
        first = client.post("/v1/responses", json={"input": "a" * 5000, "max_output_tokens": 2}).json()
        second = client.post("/v1/responses", json={"input": "more", "previous_response_id": first["id"],
                                                    "max_output_tokens": 2})
        assert second.status_code == 200 and second.json()["usage"]["input_tokens"] > 5000, second.text
        third = client.post("/v1/responses", json={"input": "again", "previous_response_id": second.json()["id"],
                                                   "max_output_tokens": 2, "stream": True})
        assert third.status_code == 200 and "response.incomplete" in third.text, third.text
        stored = client.get(f"/v1/responses/{second.json()['id']}")
        assert stored.status_code == 200 and stored.json() == second.json()
        put = client.put(f"/v1/responses/{first['id']}")
        assert put.status_code == 405 and set(put.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}, (
            put.headers)
        assert client.delete(f"/v1/responses/{first['id']}").json()["deleted"] is True
