"""Security review: what a peer with no key can make a worker do over its ports (the HTTP side and the native
protocol take no key)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
import openai
from pdtest import free_port, start_bootstrap, start_gateway, start_worker


def test_an_unauthenticated_generate_does_not_send_the_registry_token_elsewhere(procs) -> None:  # type: ignore[no-untyped-def]
    """``POST /generate`` on a decode's HTTP port takes ``bootstrap_host``/``bootstrap_port`` from the body and the
    decode asks that host for the prefill's topology, with ``Authorization: Bearer <--bootstrap-token>``: one
    request with no key hands the registry's write token to any host (which may then PUT /route: take over a
    prefill's rank)."""
    registry = start_bootstrap(procs, "--token", "s3cret", "--token-scope", "writes")
    decode = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--page-size", "4",
                          "--bootstrap-token", "s3cret", bootstrap=registry)
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(20)
    heads: list[bytes] = []

    def accept() -> None:
        try:
            conn, _ = listener.accept()
            conn.settimeout(5)
            heads.append(conn.recv(65536))
            conn.close()
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        r = httpx.post(f"http://127.0.0.1:{decode.http_port}/generate", timeout=60, json={
            "text": "hi", "sampling_params": {"max_new_tokens": 2}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": listener.getsockname()[1], "bootstrap_room": 12345})
        thread.join(timeout=30)
    finally:
        listener.close()
    assert r.status_code != 200
    assert not any(b"s3cret" in head for head in heads), heads


def test_a_huge_first_frame_on_the_native_port_is_refused_at_its_length(procs) -> None:  # type: ignore[no-untyped-def]
    """Before its ``Hello`` a peer may announce a frame of up to 64 MiB, which the worker buffers whole and then
    decodes (a ``Submit`` of 60 M token ids took the worker from 68 MB to ~600 MB resident), per connection, with
    no key. A ``Hello`` is a few bytes: a first frame over a small bound should be refused on its length."""
    worker = start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--page-size", "4")
    with socket.create_connection(("127.0.0.1", worker.port), timeout=5) as sock:
        sock.sendall(struct.pack("!I", 60_000_000))  # (the length prefix only)
        sock.settimeout(3)
        started = time.monotonic()
        try:
            answer = sock.recv(4096)
        except TimeoutError:
            answer = None
        assert answer is not None and time.monotonic() - started < 3, \
            "the worker waits for a 60 MB first frame from a peer that has not said Hello"


def test_a_worker_with_an_api_key_serves_only_peers_that_send_it(procs) -> None:  # type: ignore[no-untyped-def]
    """``pd-worker --api-key``: its native port refuses a handshake without the key (a gateway without
    ``--worker-api-key`` never gets the worker, and says why), its HTTP side every request but the health
    probes; the gateway with the key serves through it, natively and over the worker's SGLang side."""
    registry = start_bootstrap(procs)
    sim = ("--engine", "sim", "--num-pages", "64", "--page-size", "4", "--api-key", "w0rker")
    prefill = start_worker(procs, "prefill", *sim, bootstrap=registry)
    decode = start_worker(procs, "decode", *sim, bootstrap=registry)
    http = f"http://127.0.0.1:{decode.http_port}"
    assert httpx.get(f"{http}/health", timeout=10).status_code == 200  # (the probes need no key)
    assert httpx.get(f"{http}/liveness", timeout=10).status_code == 200
    for path in ("/load", "/stats", "/debug/rooms", "/get_server_info"):
        refused = httpx.get(f"{http}{path}", timeout=10)
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(f"{http}{path}", headers={"authorization": "Bearer wrong"}, timeout=10).status_code == 401
    assert httpx.get(f"{http}/load", headers={"authorization": "Bearer w0rker"}, timeout=10).status_code == 200

    port = free_port()
    procs.start(f"gateway-{port}", "-m", "gateway.cli", "--port", str(port), "--log-level", "warning",
                "--prefill", prefill.url, "--decode", decode.url)
    deadline = time.monotonic() + 30
    while True:  # the gateway comes up, its workers never do: they refuse its handshake and it says so
        try:
            workers = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()["workers"]
            if all(w["error"] and "API key" in w["error"] for w in workers):
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the workers' refusal never showed"
        time.sleep(0.2)
    assert not any(w["healthy"] for w in workers)
    assert httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=5).status_code == 503

    keyed = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url, "--worker-api-key", "w0rker")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{keyed}/v1", api_key="none", max_retries=0, timeout=60)
    assert c.completions.create(model="sim", prompt="keyed", max_tokens=3).choices[0].finish_reason == "length"
    # Its own SGLang side reaches its native port with the key (the connection it opens on first use)
    models = httpx.get(f"{http}/v1/models", headers={"authorization": "Bearer w0rker"}, timeout=30)
    assert models.status_code == 200, models.text
