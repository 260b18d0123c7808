"""Backpressure: a peer that stops reading never grows the writer's memory without bound.

* native protocol, worker -> gateway: a client that submits long generations and then never reads
  again is dropped by the worker once ``--max-unread-mib`` of its output waits unread; its requests
  end (pages back in the pool) and the worker keeps serving everyone else;
* native protocol, gateway -> worker: a worker that stops reading is dropped by the gateway's
  ``WorkerClient`` once ``max_unread_bytes`` of requests wait unread; its open requests fail
  (``WorkerGone``) instead of waiting, and the client reconnects.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import Callable

import httpx
from pdtest import Procs, SimCluster, start_gateway, start_worker

from gateway.worker_client import WorkerClient, WorkerGone
from workers.protocol import (
    PROTOCOL_VERSION,
    Hello,
    HelloAck,
    SamplingParams,
    Submit,
    gateway_codec,
    worker_codec,
)

_LEN = struct.Struct(">I")


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _read_frame(sock: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        buf = b""
        while len(buf) < n:
            part = sock.recv(n - len(buf))
            if not part:
                raise ConnectionError("closed")
            buf += part
        return buf

    (size,) = _LEN.unpack(exact(4))
    return exact(size)


def test_worker_drops_a_gateway_that_stops_reading(procs: Procs) -> None:
    fast_sim = [f"--engine-option={k}=0" for k in ("verify_kv", "prefill_token_s", "decode_step_s", "decode_seq_s")]
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "8192", "--page-size", "4",
                          "--max-unread-mib", "1", *fast_sim, name="worker")
    rss_before = _rss_kib(worker.proc.pid)
    to_worker = worker_codec()  # (an encoder for the frames a gateway sends)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: the worker's side fills
    sock.connect(("127.0.0.1", worker.port))
    # 20 top logprobs per token: ~250 bytes of output per token, so the unread output piles up fast
    params = SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=0.0, logprobs=True, top_logprobs=20)
    rid, dropped = 0, False
    try:
        sock.sendall(to_worker.encode(Hello(PROTOCOL_VERSION)))
        assert isinstance(gateway_codec().decode(_read_frame(sock)), HelloAck)
        # ...then only submit, never read: the worker must drop us, not buffer our tokens forever
        deadline = time.monotonic() + 90
        while not dropped:
            assert time.monotonic() < deadline, "the worker kept buffering for a client that does not read"
            assert worker.proc.poll() is None, procs.log("worker")
            try:
                for _ in range(100):
                    rid += 1
                    sock.sendall(to_worker.encode(Submit(rid, list(range(1, 9)), params)))
            except OSError:
                dropped = True
            time.sleep(0.1)
    finally:
        sock.close()
    assert "dropping gateway connection" in procs.log("worker") and "bytes of output unread" in procs.log("worker")
    deadline = time.monotonic() + 20
    while (load := worker.get("/load"))["num_free_pages"] != load["num_total_pages"]:  # type: ignore[index]
        assert time.monotonic() < deadline, f"its requests kept their pages: {load}"
        time.sleep(0.1)
    growth_mib = (_rss_kib(worker.proc.pid) - rss_before) / 1024
    assert growth_mib < 100, f"the worker's memory grew by {growth_mib:.0f} MiB for {rid} requests"
    port = start_gateway(procs, "--worker", worker.url)  # still serving
    r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                   json={"model": "sim", "prompt": "hello", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200, r.text


def test_gateway_drops_a_worker_that_stops_reading() -> None:
    asyncio.run(_gateway_drops_a_worker_that_stops_reading())


async def _gateway_drops_a_worker_that_stops_reading() -> None:
    """An in-process worker stand-in that answers the handshake and then never reads."""
    codec = worker_codec()
    stalled: list[asyncio.StreamWriter] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        (size,) = _LEN.unpack(await reader.readexactly(4))
        await reader.readexactly(size)  # Hello
        ack = HelloAck(PROTOCOL_VERSION, "stalled", "both", "sim", "m", "byte", 4, 4096, 64)
        writer.write(codec.encode(ack))
        stalled.append(writer)  # never read again; keep the socket open

    server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = WorkerClient(f"pd://127.0.0.1:{port}", "both", max_unread_bytes=1 << 20)
    client.start()
    try:
        assert await client.wait_ready(10)
        events: list[tuple[object, object]] = []

        class Sink:
            def put_nowait(self, item: tuple[object, object]) -> None:
                events.append(item)

        prompt = list(range(100_000))  # ~300 KB per request frame
        params = SamplingParams(max_new_tokens=4)
        sent = 0
        for i in range(200):
            if not client.is_connected:
                break
            client.submit(Submit(0, prompt, params), Sink(), i)
            sent += 1
            await asyncio.sleep(0)  # let the batched write go out
        deadline = time.monotonic() + 10
        while len(events) < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert sent < 200, "the gateway kept queueing requests for a worker that reads nothing"
        assert len(events) == sent and all(isinstance(ev, WorkerGone) for _, ev in events), events[:3]
    finally:
        await client.aclose()
        for writer in stalled:
            writer.close()
        server.close()
        await server.wait_closed()


def _gateway_metric(base_url: str, name: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def _long_stream_cluster(sim_cluster: Callable[..., SimCluster], *gateway_args: str) -> SimCluster:
    """Workers at zero model cost with room for one 60k-token stream."""
    fast_sim = [f"--engine-option={k}=0" for k in ("verify_kv", "prefill_token_s", "decode_step_s", "decode_seq_s")]
    return sim_cluster(worker_args=("--num-pages", "16384", "--engine-option=max_context=65536", *fast_sim),
                       gateway_args=gateway_args)


def _start_unread_stream(cluster: SimCluster) -> socket.socket:
    """A streaming chat request (~1.5 KB per token with 20 top logprobs) from a socket with a 4 KiB
    window that, once the response began, reads nothing more."""
    body = json.dumps({"model": "sim", "messages": [{"role": "user", "content": "go"}], "stream": True,
                       "max_tokens": 60000, "logprobs": True, "top_logprobs": 20}).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", cluster.gateway_port))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % len(body) + body)
    assert sock.recv(512).startswith(b"HTTP/1.1 200")
    return sock


def test_an_sse_client_that_stops_reading_stops_its_generation(sim_cluster: Callable[..., SimCluster]) -> None:
    """A streaming client that stops reading: once the gateway holds ``max_unread_events`` of its events
    the request is aborted on both workers (no generating for nobody), and everyone else is served."""
    cluster = _long_stream_cluster(sim_cluster, "--write-timeout-s", "600")
    gateway_pid = next(p for p in cluster.procs.procs if p.name.startswith("gateway")).pid  # type: ignore[attr-defined]
    rss_before = _rss_kib(gateway_pid)
    sock = _start_unread_stream(cluster)
    try:
        deadline = time.monotonic() + 120
        while _gateway_metric(cluster.base_url, "pd_gateway_slow_client_aborts_total") < 1:
            assert time.monotonic() < deadline, f"still generating for a client that reads nothing: " \
                                                f"{cluster.decodes[0].get('/load')}"
            time.sleep(0.2)
        cluster.wait_pools_full()
        growth_mib = (_rss_kib(gateway_pid) - rss_before) / 1024
        assert growth_mib < 100, f"the gateway's memory grew by {growth_mib:.0f} MiB for one slow client"
        r = httpx.post(f"{cluster.base_url}/v1/completions", json={"model": "sim", "prompt": "hi", "max_tokens": 4},
                       timeout=30)
        assert r.status_code == 200, r.text
    finally:
        sock.close()


def test_a_client_that_reads_nothing_for_the_write_timeout_is_cut(sim_cluster: Callable[..., SimCluster]) -> None:
    """With the event bound out of the way, a response stuck in the gateway's buffers: after
    ``--write-timeout-s`` of the client reading nothing, the connection is cut and its request ends
    on the workers; its admission slot is free again."""
    cluster = _long_stream_cluster(sim_cluster, "--write-timeout-s", "3", "--max-unread-events", "100000000")
    sock = _start_unread_stream(cluster)
    try:
        deadline = time.monotonic() + 60
        while "read nothing for 3s: disconnecting it" not in cluster.procs.log(f"gateway-{cluster.gateway_port}"):
            assert time.monotonic() < deadline, "the stuck connection was never cut"
            time.sleep(0.2)
        while _gateway_metric(cluster.base_url, "pd_gateway_active_requests") > 0:
            assert time.monotonic() < deadline, "the cut client's request is still active"
            time.sleep(0.2)
        cluster.wait_pools_full()
        assert _gateway_metric(cluster.base_url, "pd_gateway_slow_client_aborts_total") == 0
    finally:
        sock.close()
