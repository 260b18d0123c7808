"""``pd-worker --drain-timeout-s S``: on SIGTERM the requests a worker holds run on for up to S seconds while new ones
are refused ``shutting_down``; what is still held at S (or at a second signal) ends ``shutting_down``; the worker exits
0 with its pages back. Real worker processes (sim engine, slow decode steps), driven over the native protocol as a
gateway does and over SGLang's HTTP PD API as SGLang's routers do (which do not migrate a cut stream)."""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from pdtest import Procs, free_port, start_worker, wait_pools_full

from workers.cli import build_parser, config_from_args
from workers.config import ConfigError
from workers.protocol import (
    PROTOCOL_VERSION,
    Error,
    Hello,
    HelloAck,
    Outputs,
    SamplingParams,
    StepOutput,
    Submit,
    gateway_codec,
    worker_codec,
)

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4", "--engine-option", "decode_step_s=0.05")
_from_worker = gateway_codec()
_to_worker = worker_codec()


class NativePeer:
    """A blocking native-protocol connection, as a gateway's: submit, and collect each request's outputs."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(_to_worker.encode(Hello(PROTOCOL_VERSION)))
        assert isinstance(self._read(), HelloAck)
        self.tokens: dict[int, list[int]] = {}
        self.ends: dict[int, StepOutput | Error] = {}

    def _read(self) -> object:
        header = self._exact(4)
        return _from_worker.decode(self._exact(int.from_bytes(header, "big")))

    def _exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the worker closed the connection")
            data += chunk
        return data

    def submit(self, rid: int, max_new_tokens: int) -> None:
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
        self.sock.sendall(_to_worker.encode(Submit(rid, [1, 2, 3, 4, 5, 6], params, timeout_s=300.0)))
        self.tokens[rid] = []

    def read_until(self, done: object) -> None:
        """Read outputs until ``done()`` (a hang guard: the socket's own timeout)."""
        while not done():  # type: ignore[operator]
            msg = self._read()
            if isinstance(msg, Outputs):
                for item in msg.items:
                    self.tokens.setdefault(item.rid, []).extend(item.token_ids)
                    if item.finish_reason is not None:
                        self.ends[item.rid] = item
            elif isinstance(msg, Error):
                self.ends[msg.rid] = msg

    def close(self) -> None:
        self.sock.close()


def test_a_stream_under_way_at_sigterm_completes_and_a_new_request_is_refused(procs: Procs) -> None:
    """Without a drain the open stream ended ``shutting_down`` at once (a router that does not migrate cut it)."""
    worker = start_worker(procs, "both", *SIM, "--drain-timeout-s", "60")
    peer = NativePeer(worker.port)
    try:
        peer.submit(1, 40)  # (some 2 s of decoding)
        peer.read_until(lambda: len(peer.tokens[1]) >= 2 or 1 in peer.ends)
        assert 1 not in peer.ends, peer.ends
        worker.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        while worker.health_status() != 503:  # (aclose began: the drain is on from here)
            assert time.monotonic() < deadline, "/health never turned 503 stopping"
            time.sleep(0.02)
        peer.submit(2, 4)
        peer.read_until(lambda: 2 in peer.ends)
        refused = peer.ends[2]
        assert isinstance(refused, Error) and refused.code == "shutting_down", refused
        assert 1 not in peer.ends or isinstance(peer.ends[1], StepOutput), peer.ends  # (still streaming, or done)
        peer.read_until(lambda: 1 in peer.ends)
        end = peer.ends[1]
        assert isinstance(end, StepOutput) and end.finish_reason == "length", end
        assert len(peer.tokens[1]) == 40
    finally:
        peer.close()
    assert worker.proc.wait(30) == 0


def test_a_request_still_running_at_the_drain_timeout_ends_shutting_down(procs: Procs) -> None:
    worker = start_worker(procs, "both", *SIM, "--drain-timeout-s", "1")
    peer = NativePeer(worker.port)
    try:
        peer.submit(1, 900)  # (some 45 s of decoding: far past the drain; 256 pages of 4 hold it)
        peer.read_until(lambda: len(peer.tokens[1]) >= 2)
        worker.proc.send_signal(signal.SIGTERM)
        peer.read_until(lambda: 1 in peer.ends)
        end = peer.ends[1]
        assert isinstance(end, Error) and end.code == "shutting_down", end
        assert len(peer.tokens[1]) < 900
    finally:
        peer.close()
    assert worker.proc.wait(30) == 0


def test_a_second_signal_during_the_drain_ends_what_is_left_now(procs: Procs) -> None:
    worker = start_worker(procs, "both", *SIM, "--drain-timeout-s", "300")
    peer = NativePeer(worker.port)
    try:
        peer.submit(1, 900)
        peer.read_until(lambda: len(peer.tokens[1]) >= 2)
        worker.proc.send_signal(signal.SIGTERM)
        peer.submit(2, 4)  # (refused once the drain is on: proof that it is, before the second signal)
        peer.read_until(lambda: 2 in peer.ends)
        refused = peer.ends[2]
        assert isinstance(refused, Error) and refused.code == "shutting_down", refused
        assert 1 not in peer.ends, peer.ends[1]  # (the first signal did not end it)
        worker.proc.send_signal(signal.SIGINT)
        peer.read_until(lambda: 1 in peer.ends)
        end = peer.ends[1]
        assert isinstance(end, Error) and end.code == "shutting_down", end
    finally:
        peer.close()
    assert worker.proc.wait(30) == 0  # (not the 300 s drain)


def test_a_draining_decode_finishes_its_sglang_stream_and_refuses_a_new_pair(procs: Procs) -> None:
    """SGLang's routers (PD over the workers' HTTP API) retry a 503 but never migrate a stream under way: with a
    drain, a rolling restart of the decode no longer cuts it. A request sent after SIGTERM gets the 503
    ``shutting_down`` it got before, and its prefill is told at once (its room ended: no wait for pages)."""
    bootstrap_port = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
    decode = start_worker(procs, "decode", *SIM, "--drain-timeout-s", "60")
    answers: dict[str, httpx.Response] = {}

    def post(name: str, port: int, body: dict[str, object]) -> None:
        answers[name] = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)

    def body(room: int) -> dict[str, object]:
        return {"input_ids": [1, 2, 3, 4, 5], "stream": True, "bootstrap_host": "127.0.0.1",
                "bootstrap_port": bootstrap_port, "bootstrap_room": room,
                "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}}

    first = [threading.Thread(target=post, args=(f"{role}-1", port, body(7001)))
             for role, port in (("prefill", prefill.http_port), ("decode", decode.http_port))]
    for thread in first:
        thread.start()
    deadline = time.monotonic() + 20
    while decode.get("/load")["num_running"] < 1:
        assert time.monotonic() < deadline, decode.get("/load")
        time.sleep(0.02)
    decode.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 20
    while decode.health_status() != 503:
        assert time.monotonic() < deadline, "/health never turned 503 stopping"
        time.sleep(0.02)
    second = [threading.Thread(target=post, args=(f"{role}-2", port, {**body(7002), "stream": False}))
              for role, port in (("prefill", prefill.http_port), ("decode", decode.http_port))]
    for thread in second:
        thread.start()
    for thread in first + second:
        thread.join(60)
    refused = answers["decode-2"]
    assert refused.status_code == 503 and refused.headers.get("retry-after") == "1", refused.text
    assert refused.json()["error"]["code"] == "shutting_down", refused.text
    assert answers["prefill-2"].status_code == 429, answers["prefill-2"].text  # (told by the decode: turned away)
    assert answers["prefill-1"].status_code == 200, answers["prefill-1"].text
    streamed = answers["decode-1"]
    assert streamed.status_code == 200, streamed.text
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(event) for event in events[:-1]]
    assert not any("error" in chunk for chunk in chunks), chunks[-2:]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length", chunks[-1]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 40, chunks[-1]
    assert decode.proc.wait(30) == 0
    wait_pools_full([prefill])


def test_a_draining_prefill_finishes_its_prefill_and_kv_transfer(procs: Procs) -> None:
    """A prefill restarted while it computes a prompt (slow chunks) finishes it and hands its KV to the decode holding
    the room: both sides of the pair answer in full (without a drain both got ``shutting_down``/a failed room)."""
    bootstrap_port = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port), "--chunk-size", "8",
                           "--engine-option", "prefill_token_s=0.02", "--drain-timeout-s", "60")
    decode = start_worker(procs, "decode", *SIM)
    answers: dict[str, httpx.Response] = {}

    def post(name: str, port: int) -> None:
        body = {"input_ids": list(range(1, 121)), "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap_port,
                "bootstrap_room": 7101, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0}}
        answers[name] = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)

    threads = [threading.Thread(target=post, args=item)
               for item in (("prefill", prefill.http_port), ("decode", decode.http_port))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 20
    # (prefilling, some 2.4 s of chunks: the decode holds the room. One the decode looks up only after SIGTERM is
    # found too, the entry being kept draining: tests/integration/test_draining_prefill_stays_findable.py)
    while not prefill.get("/load")["num_running"]:
        assert time.monotonic() < deadline, prefill.get("/load")
        time.sleep(0.02)
    prefill.proc.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(60)
    assert answers["prefill"].status_code == 200, answers["prefill"].text
    assert answers["decode"].status_code == 200, answers["decode"].text
    assert answers["decode"].json()["meta_info"]["completion_tokens"] == 8, answers["decode"].text
    assert prefill.proc.wait(30) == 0
    wait_pools_full([decode])


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_bad_drain_timeout_is_refused(value: str) -> None:
    with pytest.raises(ConfigError, match="drain_timeout_s"):
        config_from_args(build_parser().parse_args(["--drain-timeout-s", value]))


def test_the_drain_is_off_by_default() -> None:
    assert config_from_args(build_parser().parse_args([])).drain_timeout_s == 0.0


def test_pd_cluster_passes_the_drain_on_to_its_workers() -> None:
    from gateway.cluster import _children_args_problem
    from gateway.cluster import build_parser as cluster_parser

    assert _children_args_problem(cluster_parser().parse_args(["--worker-arg=--drain-timeout-s=5"])) is None
    problem = _children_args_problem(cluster_parser().parse_args(["--worker-arg=--drain-timeout-s=-1"]))
    assert problem is not None and "drain_timeout_s" in problem
