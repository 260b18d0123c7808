"""Hypothesis fuzzing of the framed wire protocols, each against real processes of a sim cluster.

- A worker's native port (gateway -> worker frames): garbage, truncated frames, oversized length
  headers, a wrong protocol version, messages of the other direction, tagged maps of any shape, and
  well-typed ``Submit`` frames holding nonsense (NaN temperature, rooms and ports of any value).
- The gateway's worker connection (worker -> gateway frames): a fake worker, added through the admin
  API, answers the gateway's ``Hello`` with a fuzzed byte stream.
- A prefill's KV control port (``transfer/messages.py`` frames, what a decode sends).
Each example is one connection. When the input is invalid (it does not decode, or is a message
that side must not get) the receiving process ends that connection; whatever it was, the process
then still serves everyone else: a probe on a connection opened before the fuzzing and one on a
fresh connection are answered, and at the end a request through the gateway completes (the
``sim_cluster`` fixture also checks every KV pool is full again). Examples are derandomized.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdtest import SimCluster
from wire import (
    GARBAGE,
    INT64,
    closed_by_peer,
    connect,
    deep_array,
    deep_map,
    encode,
    frame,
    oversized_header,
    read_frame,
    send_all,
    tagged_arrays,
    tagged_maps,
    whole_frames,
)

from transfer import messages as ctl
from workers import protocol as native

EXAMPLES = 40
FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=list(HealthCheck))
_to_gateway = native.gateway_codec()  # decodes what a worker sends
_to_worker = native.worker_codec()  # decodes what a gateway sends


def completes(cluster: SimCluster) -> None:
    """A request through the gateway completes, and no process logged a traceback (an error nobody handled)."""
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "hi there", "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    for proc in cluster.procs.procs:
        log = cluster.procs.log(proc.name)  # type: ignore[attr-defined]
        assert "Traceback" not in log, log[-3000:]


# -- a worker's native port -------------------------------------------------------------------------
HELLO = encode(native.Hello(native.PROTOCOL_VERSION))
SUBMITS = st.builds(
    native.Submit,
    rid=INT64,
    input_ids=st.lists(st.integers(-5, 300), max_size=12),
    params=st.builds(native.SamplingParams, max_new_tokens=st.integers(-3, 40), temperature=st.floats(),
                     top_p=st.floats(), top_k=st.integers(-3, 400), min_p=st.floats(), seed=st.none() | INT64,
                     stop_token_ids=st.lists(st.integers(-3, 300), max_size=3), ignore_eos=st.booleans(),
                     logprobs=st.booleans(), top_logprobs=st.integers(-3, 30), prompt_logprobs=st.booleans(),
                     output_offset=st.integers(-3, 50)),
    bootstrap=st.none() | st.builds(native.BootstrapTarget, host=st.sampled_from(["127.0.0.1", "", "x" * 300]),
                                    port=st.none() | st.integers(-1, 70000), room=INT64,
                                    instance_id=st.none() | st.text(max_size=8)),
    timeout_s=st.floats(),
    request_id=st.text(max_size=20),
)
TO_WORKER_KINDS = ["hello", "submit", "abort", "ping", "hello_ack", "out", "pong", "nope"]
TO_WORKER_FIELDS = ["rid", "version", "input_ids", "params", "bootstrap", "nonce", "reason", "timeout_s"]
TO_WORKER = st.one_of(
    GARBAGE,
    GARBAGE.map(frame),
    oversized_header(native.MAX_FRAME_BYTES),
    st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != native.PROTOCOL_VERSION).map(
        lambda v: encode(native.Hello(v))),
    st.builds(lambda body, cut: (HELLO + frame(body))[:cut], GARBAGE, st.integers(1, 40)),  # truncated
    GARBAGE.map(lambda body: HELLO + frame(body)),
    oversized_header(native.MAX_FRAME_BYTES).map(lambda head: HELLO + head),
    tagged_maps(TO_WORKER_KINDS, TO_WORKER_FIELDS).map(lambda msg: HELLO + encode(msg)),
    st.lists(SUBMITS, min_size=1, max_size=3).map(lambda subs: HELLO + b"".join(map(encode, subs))),
    st.just(HELLO + encode(native.HelloAck(2, "w", "decode", "sim", "sim", "byte", 4, 64, 8))),
    st.just(HELLO + HELLO),
    deep_map("hello").map(frame),
    deep_map("ping").map(lambda body: HELLO + frame(body)),
)


def _worker_must_close(data: bytes) -> bool:
    """Whether a worker must end the connection on ``data``: its first whole frame is not our Hello, or
    a later whole frame does not decode or is not Submit/Abort/Ping (a partial frame may yet complete)."""
    for i, body in enumerate(whole_frames(data, native.MAX_FRAME_BYTES)):
        if body is None:
            return True
        try:
            msg = _to_worker.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return True
        if i == 0 and not (isinstance(msg, native.Hello) and msg.version == native.PROTOCOL_VERSION):
            return True
        if i > 0 and not isinstance(msg, native.Submit | native.Abort | native.Ping):
            return True
    return False


class NativePeer:
    """A gateway-side connection to a worker that has done its handshake."""

    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        assert send_all(self.sock, HELLO)
        ack = self.next_message()
        assert isinstance(ack, native.HelloAck), ack
        self.nonce = 0

    def next_message(self) -> object:
        body = read_frame(self.sock)
        assert body is not None, "the worker closed a good connection"
        return _to_gateway.decode(body)

    def ping(self) -> native.Pong:
        self.nonce += 1
        assert send_all(self.sock, encode(native.Ping(self.nonce)))
        while True:  # load reports and KV events come and go meanwhile
            msg = self.next_message()
            if isinstance(msg, native.Pong) and msg.nonce == self.nonce:
                return msg

    def close(self) -> None:
        self.sock.close()


def test_worker_native_port_survives_garbage(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    ports = {"prefill": cluster.prefills[0].port, "decode": cluster.decodes[0].port}
    steady = {role: NativePeer(port) for role, port in ports.items()}

    @FUZZ
    @given(role=st.sampled_from(sorted(ports)), data=TO_WORKER)
    def one_connection(role: str, data: bytes) -> None:
        with connect(ports[role]) as sock:
            sent = send_all(sock, data)
            if sent and _worker_must_close(data):
                assert closed_by_peer(sock), f"the {role} worker kept a connection that sent {data[:80]!r}"
        pong = steady[role].ping()
        assert math.isfinite(pong.stalled_s), f"the {role} worker's scheduler died"
        NativePeer(ports[role]).close()

    one_connection()
    for peer in steady.values():
        peer.close()
    completes(cluster)


# -- the gateway's worker connection ---------------------------------------------------------------
def _ack(**changes: Any) -> native.HelloAck:
    fields = {"version": native.PROTOCOL_VERSION, "worker_id": "fake", "role": "decode", "engine": "sim",
              "model": "sim", "tokenizer": "byte", "page_size": 4, "max_context": 2048, "num_pages": 256,
              **changes}
    return native.HelloAck(**fields)


ACK = encode(_ack())
TO_GATEWAY_KINDS = ["hello_ack", "rejected", "out", "error", "load", "kv", "pong", "submit", "nope"]
TO_GATEWAY_FIELDS = ["version", "role", "page_size", "num_pages", "max_context", "items", "rid", "code",
                     "message", "num_running", "num_free_pages", "num_total_pages", "stored", "removed", "nonce"]
LOADS = st.builds(native.LoadReport, num_running=INT64, num_waiting=INT64, num_free_pages=INT64,
                  num_total_pages=INT64, num_prefill_tokens=INT64, last_rid=INT64, prefill_tokens_per_s=st.floats(),
                  busy_fraction=st.floats())
EVENTS = st.builds(native.KVEvents, stored=st.lists(st.binary(max_size=9), max_size=4),
                   removed=st.lists(st.binary(max_size=9), max_size=4), reset=st.booleans())
OUTPUTS = st.builds(native.Outputs, st.lists(st.builds(native.StepOutput, rid=INT64,
                                                       token_ids=st.lists(st.integers(0, 300), max_size=3)),
                                             max_size=3))
TO_GATEWAY = st.one_of(
    GARBAGE,
    GARBAGE.map(frame),
    oversized_header(native.MAX_FRAME_BYTES),
    st.integers(-(2**63), 2**63 - 1).filter(lambda v: v != native.PROTOCOL_VERSION).map(
        lambda v: encode(_ack(version=v))),
    st.sampled_from(["prefill", "both", "", "decode "]).map(lambda role: encode(_ack(role=role))),
    st.tuples(st.integers(-5, 0), st.integers(-5, 0)).map(lambda p: encode(_ack(page_size=p[0], num_pages=p[1]))),
    st.just(encode(native.Rejected("go away"))),
    GARBAGE.map(lambda body: ACK + frame(body)),
    st.builds(lambda body, cut: (ACK + frame(body))[:cut], GARBAGE, st.integers(1, 40)),
    oversized_header(native.MAX_FRAME_BYTES).map(lambda head: ACK + head),
    tagged_maps(TO_GATEWAY_KINDS, TO_GATEWAY_FIELDS).map(lambda msg: ACK + encode(msg)),
    st.lists(st.one_of(LOADS, EVENTS, OUTPUTS), min_size=1, max_size=3).map(
        lambda msgs: ACK + b"".join(map(encode, msgs))),
    st.just(ACK + ACK),
    deep_map("hello_ack").map(frame),
    deep_map("pong").map(lambda body: ACK + frame(body)),
)


def _gateway_must_close(data: bytes) -> bool:
    """Whether the gateway must end the connection: a first whole frame that is no good HelloAck (protocol
    version, role decode, a positive KV shape), or a later one that does not decode or is a handshake message.
    (A partial frame may yet complete; the handshake's times out in 5 s.)"""
    for i, body in enumerate(whole_frames(data, native.MAX_FRAME_BYTES)):
        if body is None:
            return True
        try:
            msg = _to_gateway.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
            return True
        if i == 0 and not (isinstance(msg, native.HelloAck) and msg.version == native.PROTOCOL_VERSION
                           and msg.role == "decode" and min(msg.page_size, msg.num_pages, msg.max_context) > 0):
            return True
        if i > 0 and isinstance(msg, native.HelloAck | native.Rejected):
            return True
    return False


class FakeWorker:
    """A listening socket that answers the gateway's next connection with a given byte stream."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.url = f"pd://127.0.0.1:{self.port}"

    def accept(self, timeout_s: float = 10.0) -> socket.socket:
        self.listener.settimeout(timeout_s)
        sock, _ = self.listener.accept()
        sock.settimeout(5.0)
        return sock

    def refuse_pending(self) -> None:
        """Close every connection the gateway has queued (its reconnects)."""
        self.listener.settimeout(0.0)
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, TimeoutError):
                return
            sock.close()


def _listed(http: httpx.Client, url: str) -> bool:
    return any(w["url"] == url for w in http.get("/workers").json()["workers"])


def test_gateway_survives_a_worker_sending_garbage(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    fake = FakeWorker()
    http = httpx.Client(base_url=cluster.base_url, timeout=30)

    @FUZZ
    @given(data=TO_GATEWAY)
    def one_connection(data: bytes) -> None:
        fake.refuse_pending()
        r = http.post("/workers", json={"url": fake.url, "role": "decode"})
        assert r.status_code == 201, r.text
        with fake.accept() as sock:
            hello = read_frame(sock)
            assert hello is not None and isinstance(_to_worker.decode(hello), native.Hello)
            sent = send_all(sock, data)
            if sent and _gateway_must_close(data):
                assert closed_by_peer(sock, 8.0), f"the gateway kept a worker connection that sent {data[:80]!r}"
        assert http.delete("/workers", params={"url": fake.url}).status_code == 202
        deadline = time.monotonic() + 10
        while _listed(http, fake.url):
            assert time.monotonic() < deadline, "the fake worker was not removed"
            fake.refuse_pending()
            time.sleep(0.02)
        completes(cluster)

    one_connection()
    fake.listener.close()
    assert http.get("/readiness").status_code == 200
    http.close()


# -- a prefill's KV control port -------------------------------------------------------------------
def _control_port(cluster: SimCluster) -> int:
    instances = httpx.get(f"{cluster.bootstrap_url}/instances", timeout=10).json()["instances"]
    return int(instances[0]["ranks"][0]["rank_port"])


_register = ctl.Register(ctl.PROTOCOL_VERSION, "tcp", b"127.0.0.1:1", [1, 2], [64, 64], [16, 16], [3], [8], [8], 4,
                         "float32")
REGISTERS = st.builds(ctl.Register, version=INT64, backend=st.sampled_from(["tcp", "nixl", ""]),
                      endpoint=st.binary(max_size=16), kv_ptrs=st.lists(INT64, max_size=4),
                      kv_data_lens=st.lists(INT64, max_size=4), kv_item_lens=st.lists(INT64, max_size=4),
                      aux_ptrs=st.lists(INT64, max_size=2), aux_data_lens=st.lists(INT64, max_size=2),
                      aux_item_lens=st.lists(INT64, max_size=2), page_size=INT64,
                      kv_dtype=st.sampled_from(["float32", "bfloat16", "x"]))
CONTROL_KINDS = ["register", "register_ack", "room", "status", "abort", "quiesced", "ping", "pong", "nope"]
TO_PREFILL = st.one_of(
    GARBAGE,
    GARBAGE.map(frame),
    oversized_header(ctl.MAX_FRAME_BYTES),
    st.builds(lambda body, cut: frame(body)[:cut], GARBAGE, st.integers(1, 40)),
    tagged_arrays(CONTROL_KINDS).map(encode),
    tagged_maps(CONTROL_KINDS, ["room", "version", "seq"]).map(encode),
    REGISTERS.map(encode),
    st.builds(lambda room: encode(ctl.RoomRequest(room, [0, 1], 0)), INT64),  # before Register
    st.builds(lambda room: encode(ctl.Abort(room, "x")), INT64),
    st.just(encode(ctl.Pong(1)) + encode(_register)),
    deep_array("ping", 1).map(frame),
)


def _prefill_must_close(data: bytes) -> bool:
    """A whole frame that does not decode, or is a message a prefill never gets, or a Register (none of
    ours is valid) or a room before registering, ends the connection."""
    for body in whole_frames(data, ctl.MAX_FRAME_BYTES):
        if body is None:
            return True
        try:
            msg = ctl.decode_body(body)
        except Exception:
            return True
        if not isinstance(msg, ctl.Ping | ctl.Pong | ctl.Abort):
            return True
    return False


class ControlPeer:
    def __init__(self, port: int) -> None:
        self.sock = connect(port)
        self.seq = 0

    def ping(self) -> None:
        self.seq += 1
        assert send_all(self.sock, ctl.encode_frame(ctl.Ping(self.seq)))
        while True:  # the prefill's own heartbeat pings come meanwhile
            body = read_frame(self.sock)
            assert body is not None, "the prefill closed a good control connection"
            msg = ctl.decode_body(body)
            if isinstance(msg, ctl.Pong) and msg.seq == self.seq:
                return


def test_prefill_control_port_survives_garbage(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    port = _control_port(cluster)
    steady = ControlPeer(port)

    @FUZZ
    @given(data=TO_PREFILL)
    def one_connection(data: bytes) -> None:
        with connect(port) as sock:
            if send_all(sock, data) and _prefill_must_close(data):
                assert closed_by_peer(sock), f"the prefill kept a control connection that sent {data[:80]!r}"
        steady.ping()
        fresh = ControlPeer(port)
        fresh.ping()
        fresh.sock.close()

    one_connection()
    steady.sock.close()
    completes(cluster)  # a real decode's control connection to this prefill still works



def _rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_length_header_alone_allocates_nothing(sim_cluster: Callable[..., SimCluster]) -> None:
    """Eight connections each send a header claiming the largest frame allowed, then one byte: neither the
    prefill's control port (it used to allocate the whole claimed length at once: 512 MiB here) nor its
    native port grows by anything like the claimed sizes."""
    cluster = sim_cluster()
    prefill = cluster.prefills[0]
    before = _rss_bytes(prefill.proc.pid)
    socks = []
    for port, limit in ((_control_port(cluster), ctl.MAX_FRAME_BYTES), (prefill.port, native.MAX_FRAME_BYTES)):
        for _ in range(8):
            sock = connect(port)
            assert send_all(sock, limit.to_bytes(4, "big") + b"x")
            socks.append(sock)
    steady = ControlPeer(_control_port(cluster))
    steady.ping()  # every one of them has been read by now (the control port reads in order of arrival)
    NativePeer(prefill.port).ping()
    time.sleep(0.5)
    grown = _rss_bytes(prefill.proc.pid) - before
    assert grown < 64 * 1024 * 1024, f"the prefill grew by {grown / 2**20:.0f} MiB"
    for sock in socks:
        sock.close()
    steady.sock.close()
    completes(cluster)
