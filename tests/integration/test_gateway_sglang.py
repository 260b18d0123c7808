"""Our gateway in front of workers that speak only SGLang's HTTP PD protocol (``gateway/sglang_relay.py``).

The workers are stand-ins written from the protocol (``sglang_standin.py``: HTTP only, no KV) that
log the bootstrap fields of every request, so the tests check that the prefill and the decode got
the same room and valid bootstrap fields, streamed and not, per item for ``n > 1`` and batches,
the logprob merge, and the failure coupling: a prefill that fails cancels the decode's request, a
failing side is retried on new rooms and then answered with a clear error. One more test puts the
gateway in front of our own workers through their SGLang HTTP side, giving what the native path
gives.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import openai
import pytest
from pdtest import Procs, free_port, start_gateway, start_worker, wait_http_ok

from gateway.sglang_routing import ROUTING_PAGE_TOKENS

T = TypeVar("T")

MAX_ROOM = 2**63 - 1


@dataclass
class Fleet:
    base_url: str
    prefill_logs: list[Path]
    decode_log: Path
    bootstrap_ports: list[int | None]

    def entries(self, path: Path, event: str = "request") -> list[dict]:  # type: ignore[type-arg]
        if not path.exists():
            return []
        return [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]

    def prefill_requests(self) -> list[dict]:  # type: ignore[type-arg]
        return [e for log in self.prefill_logs for e in self.entries(log)]

    def prefill_requests_for(self, room: object) -> list[dict]:  # type: ignore[type-arg]
        return eventually(lambda: [e for e in self.prefill_requests() if e["bootstrap_room"] == room])

    def prefill_port_of(self, room: object) -> list[int | None]:
        """The bootstrap ports of the prefills that logged ``room``."""
        return eventually(lambda: [port for log, port in zip(self.prefill_logs, self.bootstrap_ports, strict=True)
                                   for e in self.entries(log) if e["bootstrap_room"] == room])


def eventually(look: Callable[[], list[T]], timeout_s: float = 5.0) -> list[T]:
    """``look()`` once it finds something, or its last (empty) answer after ``timeout_s``. The relay answers
    from the decode and lets the prefill's request end on its own, so a client may have its answer before
    the prefill stand-in logged the request."""
    deadline = time.monotonic() + timeout_s
    while not (found := look()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return found


def start_standin(procs: Procs, role: str, log: Path, api_key: str | None = None) -> int:
    port = free_port()
    proc = procs.start(f"standin-{role}-{port}", "tests/integration/sglang_standin.py", "--role", role,
                       "--port", str(port), "--log", str(log), *(("--api-key", api_key) if api_key else ()))
    if api_key is None:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 30, proc)
        return port
    deadline = time.monotonic() + 30
    while True:
        assert proc.poll() is None, f"the {role} stand-in exited with {proc.returncode}"
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", headers={"authorization": f"Bearer {api_key}"},
                         timeout=2).status_code == 200:
                return port
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"the {role} stand-in did not answer /health"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    tmp = tmp_path_factory.mktemp("sglang-fleet")
    procs = Procs(tmp)
    try:
        logs = [tmp / "prefill-0.jsonl", tmp / "prefill-1.jsonl"]
        p0, p1 = (start_standin(procs, "prefill", log) for log in logs)
        decode_log = tmp / "decode.jsonl"
        d = start_standin(procs, "decode", decode_log)
        port = start_gateway(procs, "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{p0}", "7001",
                             "--prefill", f"http://127.0.0.1:{p1}", "none", "--decode", f"http://127.0.0.1:{d}",
                             "--retry-backoff-s", "0.01", "--health-interval-s", "0.2",
                             "--stream-idle-timeout-s", "1",  # (below DECODE_SLOW_HEAD's 2 s)
                             "--breaker-failures", "1000")  # the failure tests must not open a breaker
        yield Fleet(f"http://127.0.0.1:{port}", logs, decode_log, [7001, None])
    finally:
        procs.stop_all()


def post(fleet: Fleet, path: str, body: dict, **kwargs: object) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(f"{fleet.base_url}{path}", json=body, timeout=30, **kwargs)  # type: ignore[arg-type]


def check_pair(fleet: Fleet, room: object) -> None:
    """The prefill and the decode got this room, with the chosen prefill's host and bootstrap port."""
    (d_entry,) = [e for e in fleet.entries(fleet.decode_log) if e["bootstrap_room"] == room]
    assert isinstance(room, int) and 0 <= room <= MAX_ROOM
    ports = fleet.prefill_port_of(room)
    assert len(ports) == 1, "exactly one prefill got the room"
    assert d_entry["bootstrap_host"] == "127.0.0.1" and d_entry["bootstrap_port"] == ports[0]


def test_generate_whole_and_streamed_same_room_on_both(fleet: Fleet) -> None:
    r = post(fleet, "/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200, r.text
    room = int(r.json()["text"].split()[1])
    check_pair(fleet, room)
    with httpx.stream("POST", f"{fleet.base_url}/generate", json={"text": "hello", "stream": True},
                      timeout=30) as reply:
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
        events = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == 3
    room = int(json.loads(events[-2])["text"].split()[1])
    check_pair(fleet, room)
    assert {p for e in fleet.prefill_requests() for p in [e["bootstrap_port"]]} <= {7001, None}


def test_both_prefills_take_turns_with_their_own_bootstrap_ports(fleet: Fleet) -> None:
    rooms = [int(post(fleet, "/generate", {"text": "turns"}).json()["text"].split()[1]) for _ in range(4)]
    ports = [fleet.prefill_port_of(room)[0] for room in rooms]
    assert sorted(ports, key=str) == sorted([7001, 7001, None, None], key=str), ports


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_routes_pass_through(fleet: Fleet, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{fleet.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    messages = [{"role": "user", "content": "hi there"}]
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(model="standin-model", messages=messages, stream=True)  # type: ignore[arg-type]
                       if c.choices)
        completion = "".join(c.choices[0].text for c in
                             client.completions.create(model="standin-model", prompt="once", stream=True)
                             if c.choices)
    else:
        text = client.chat.completions.create(model="standin-model", messages=messages).choices[0].message.content  # type: ignore[arg-type,assignment]
        completion = client.completions.create(model="standin-model", prompt="once").choices[0].text
    for out in (text, completion):
        word, room = out.split()
        assert word == "decoded"
        check_pair(fleet, int(room))
    assert client.models.list().data[0].id == "standin-model"


def test_n_and_batches_get_a_room_per_item(fleet: Fleet) -> None:
    r = post(fleet, "/v1/chat/completions", {"messages": [{"role": "user", "content": "two please"}], "n": 2})
    assert r.status_code == 200, r.text
    r = post(fleet, "/generate", {"text": ["first", "second", "third"]})
    assert r.status_code == 200, r.text
    lists = [e for e in fleet.entries(fleet.decode_log) if isinstance(e["bootstrap_room"], list)]
    by_size = {len(e["bootstrap_room"]): e for e in lists}
    for size in (2, 3):
        entry = by_size[size]
        assert len(set(entry["bootstrap_room"])) == size, "one fresh room per item"
        assert entry["bootstrap_host"] == ["127.0.0.1"] * size and len(entry["bootstrap_port"]) == size
        prefill = fleet.prefill_requests_for(entry["bootstrap_room"])
        assert len(prefill) == 1 and prefill[0]["bootstrap_port"] == entry["bootstrap_port"]


def test_prefill_input_logprobs_are_merged(fleet: Fleet) -> None:
    r = post(fleet, "/generate", {"text": "abc", "return_logprob": True})
    assert r.json()["meta_info"]["input_token_logprobs"] == [[-0.5, ord(c), None] for c in "abc"]
    with httpx.stream("POST", f"{fleet.base_url}/generate", json={"text": "abcd", "return_logprob": True,
                                                                 "stream": True}, timeout=30) as reply:
        events = [json.loads(line[6:]) for line in reply.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert len(events) == 2, "the prefill's SSE reply was read, the decode's events kept"
    for event in events:
        assert event["meta_info"]["input_token_logprobs"] == [[-0.5, ord(c), None] for c in "abcd"]


def test_a_prefill_4xx_is_the_clients_and_cancels_the_decode(fleet: Fleet) -> None:
    started = time.monotonic()
    r = post(fleet, "/generate", {"text": "PREFILL_400 DECODE_WAITS"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "prefill refuses"
    assert time.monotonic() - started < 10, "the decode's 30 s wait was not awaited"
    (entry,) = [e for e in fleet.entries(fleet.decode_log) if e["text"] == "PREFILL_400 DECODE_WAITS"]
    deadline = time.monotonic() + 10
    room = entry["bootstrap_room"]
    while not [e for e in fleet.entries(fleet.decode_log, "cancelled") if e["bootstrap_room"] == room]:
        assert time.monotonic() < deadline, "the decode's request was not cancelled"
        time.sleep(0.1)
    assert len([e for e in fleet.prefill_requests() if e["text"] == "PREFILL_400 DECODE_WAITS"]) == 1, "no retry"


@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_failing_side_is_retried_on_new_rooms_then_a_502(fleet: Fleet, side: str, stream: bool) -> None:
    text = f"{side.upper()}_500 {'s' if stream else 'w'}"
    r = post(fleet, "/generate", {"text": text, "stream": stream})
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "upstream_error" and f"SGLang {side} worker" in err["message"]
    log = fleet.decode_log if side == "decode" else None
    attempts = [e for e in (fleet.entries(log) if log else fleet.prefill_requests()) if e["text"] == text]
    assert len(attempts) == 3, "--max-retries 2: three attempts"
    assert len({e["bootstrap_room"] for e in attempts}) == 3, "a new room per attempt"


def test_a_streams_first_token_may_take_longer_than_the_idle_timeout(fleet: Fleet) -> None:
    """Our workers send a stream's response head with its first token: waiting for it is the first-token
    timeout's (300 s), not the 1 s between events; one decode attempt, answered."""
    text = "DECODE_SLOW_HEAD s"
    r = post(fleet, "/generate", {"text": text, "stream": True})
    assert r.status_code == 200 and "decoded" in r.text and "error" not in r.text, r.text
    assert len([e for e in fleet.entries(fleet.decode_log) if e["text"] == text]) == 1


def test_a_prefill_failing_after_the_decodes_head_is_retried(fleet: Fleet) -> None:
    """SGLang's decode sends a stream's head at once, then waits for the KV: a prefill failing after
    that is still a failure before the client's first byte, retried on new rooms, each decode request
    closed; not a 200 whose stream ends in an error when the decode gives up."""
    text = "PREFILL_500 HEAD_FIRST"
    r = post(fleet, "/generate", {"text": text, "stream": True})
    assert r.status_code == 502 and "SGLang prefill worker" in r.json()["error"]["message"], r.text
    rooms = {e["bootstrap_room"] for e in fleet.prefill_requests() if e["text"] == text}
    assert len(rooms) == 3, "three attempts"

    def left_open() -> set[int]:  # decode streams that sent their head and were not closed (yet)
        waiting = {e["bootstrap_room"] for e in fleet.entries(fleet.decode_log, "waiting")} & rooms
        return waiting - {e["bootstrap_room"] for e in fleet.entries(fleet.decode_log, "cancelled")}

    deadline = time.monotonic() + 10
    while left_open():
        assert time.monotonic() < deadline, f"decode streams left open: {left_open()}"
        time.sleep(0.05)


def test_a_client_leaving_with_a_request_pipelined_behind_its_stream_cancels_it(fleet: Fleet) -> None:
    """The relayed stream being answered is not the newest request on its connection (one is pipelined behind
    it): its client leaving still reaches it, and its decode's request is closed, not left to its own end."""
    text = "DECODE_WAITS HEAD_FIRST pipelined"
    body = json.dumps({"text": text, "stream": True}).encode()
    port = int(fleet.base_url.rpartition(":")[2])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body) + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        (entry,) = eventually(lambda: [e for e in fleet.entries(fleet.decode_log) if e["text"] == text])
        room = entry["bootstrap_room"]

        def logged(event: str) -> list[dict]:  # type: ignore[type-arg]
            return [e for e in fleet.entries(fleet.decode_log, event) if e["bootstrap_room"] == room]

        assert eventually(lambda: logged("waiting"))  # (its head went out; it waits for KV that never comes)
    assert eventually(lambda: logged("cancelled"), timeout_s=10), "its decode request was left open"


def _requests_counted(fleet: Fleet, route: str, status: str) -> float:
    lines = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("pd_gateway_requests_total{")
               and f'route="{route}"' in line and f'status="{status}"' in line)


def test_a_decode_breaking_mid_event_ends_the_stream_with_a_clean_error_event(fleet: Fleet) -> None:
    ok_before, bad_before = (_requests_counted(fleet, "generate", s) for s in ("200", "502"))
    r = post(fleet, "/generate", {"text": "DECODE_BREAKS s", "stream": True})
    assert r.status_code == 200
    events = [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", r.text  # (as the native path ends a broken stream)
    decoded = [json.loads(e) for e in events[:-1]]  # every event whole: nothing of the broken one
    assert decoded[0] == {"text": "one"} and decoded[-1]["error"]["type"] == "upstream_error", r.text
    assert len(decoded) == 2
    # counted under the status the client got (the head's 200), as the native path counts it
    assert _requests_counted(fleet, "generate", "200") == ok_before + 1
    assert _requests_counted(fleet, "generate", "502") == bad_before


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batch_gets_each_prompts_own_prefill_logprobs(fleet: Fleet, stream: bool) -> None:
    """``return_logprob`` on a batched ``/generate``: each item's prompt logprobs (the prefill's) go in front of
    that item's own (the decode's), matched by position or by the events' ``index``."""
    texts = ["BATCHLP a", "BATCHLP bb"]
    r = post(fleet, "/generate", {"text": texts, "return_logprob": True, "stream": stream})
    assert r.status_code == 200, r.text
    if stream:
        items = [json.loads(line[len("data: "):]) for line in r.text.split("\n\n")
                 if line.startswith("data: ") and line != "data: [DONE]"]
    else:
        items = [dict(item, index=i) for i, item in enumerate(r.json())]
    assert sorted(item["index"] for item in items) == [0, 1]
    for item in items:
        i = item["index"]
        want = [[-0.5, ord(c), None] for c in texts[i]] + [[-1.0, i, None]]
        assert item["meta_info"]["input_token_logprobs"] == want, (stream, item)


def test_the_clients_trace_context_reaches_both_workers(fleet: Fleet) -> None:
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = post(fleet, "/generate", {"text": "traced"}, headers={"traceparent": parent, "tracestate": "gw=1"})
    assert r.status_code == 200, r.text
    room = int(r.json()["text"].split()[1])
    (decode,) = [e for e in fleet.entries(fleet.decode_log) if e["bootstrap_room"] == room]
    prefill = fleet.prefill_requests_for(room)
    assert len(prefill) == 1
    for entry in (decode, prefill[0]):
        assert (entry["traceparent"], entry["tracestate"]) == (parent, "gw=1")


def test_requests_open_on_sglang_workers_count_in_their_load(fleet: Fleet) -> None:
    """Between load polls (the stand-ins have no ``/v1/loads``: the gateway's own counts only), a request
    open on a prefill counts its prompt there, so load-aware policies see the requests they routed."""
    import concurrent.futures

    def prefill_tokens() -> list[int]:
        workers = httpx.get(f"{fleet.base_url}/readiness", timeout=10).json()["workers"]
        return [w["prefill_tokens"] for w in workers if w["role"] == "prefill"]

    assert prefill_tokens() == [0, 0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(post, fleet, "/generate", {"text": "SLOW_PREFILL " + "x" * 400})
        assert eventually(lambda: [n for n in prefill_tokens() if n > 0]), "the open prefill request counts"
        (tokens,) = [n for n in prefill_tokens() if n > 0]
        assert tokens >= 100, tokens  # (no --tokenizer here: guessed from the body's size)
        assert answer.result().status_code == 200
    assert eventually(lambda: [True] if prefill_tokens() == [0, 0] else [], 10), "and no longer once it ended"


def test_a_prefill_reply_late_for_its_logprobs_does_not_hold_the_stream(fleet: Fleet) -> None:
    """A stream with ``return_logprob`` waits for the prefill's prompt logprobs no longer than the gap allowed
    between events (here 1 s): a prefill that answers after 5 s leaves them out; the stream goes on."""
    r = post(fleet, "/generate", {"text": "SLOW_PREFILL x", "return_logprob": True, "stream": True})
    assert r.status_code == 200, r.text
    events = [json.loads(line[len("data: "):]) for line in r.text.split("\n\n")
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert events and events[-1]["text"].startswith("decoded"), r.text
    assert all(e["meta_info"]["input_token_logprobs"] == [] for e in events), r.text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_decode_500_that_breaks_off_is_retried_then_a_502(fleet: Fleet, stream: bool) -> None:
    text = f"DECODE_500 DECODE_BREAKS {'s' if stream else 'w'}"
    r = post(fleet, "/generate", {"text": text, "stream": stream})
    assert r.status_code == 502 and r.json()["error"]["type"] == "upstream_error", r.text
    assert len([e for e in fleet.entries(fleet.decode_log) if e["text"] == text]) == 3


def test_health_reports_the_sglang_workers(fleet: Fleet) -> None:
    body = httpx.get(f"{fleet.base_url}/readiness", timeout=10).json()
    assert body["ready"] is True
    assert sorted(w["role"] for w in body["workers"]) == ["decode", "prefill", "prefill"]
    assert all(w["healthy"] for w in body["workers"])
    assert not any(w["load_fresh"] for w in body["workers"]), "no /v1/loads on the stand-ins: own counts"
    metrics = httpx.get(f"{fleet.base_url}/metrics", timeout=10).text
    healthy = [line for line in metrics.splitlines() if line.startswith("pd_gateway_worker_healthy{")]
    assert len(healthy) == 3 and all(line.endswith(" 1.0") and "http://127.0.0.1:" in line for line in healthy)
    listed = httpx.get(f"{fleet.base_url}/workers", timeout=10).json()["workers"]  # (the admin API lists them too)
    assert sorted(w["url"] for w in listed) == sorted(w["url"] for w in body["workers"])


def test_gateway_over_our_workers_sglang_side_matches_the_native_path(procs: Procs) -> None:
    bootstrap_port = free_port()
    sim = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")
    prefill = start_worker(procs, "prefill", *sim, "--bootstrap-embedded", str(bootstrap_port))
    decode = start_worker(procs, "decode", *sim)
    native = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
    http = start_gateway(procs, "--prefill", f"http://127.0.0.1:{prefill.http_port}", str(bootstrap_port),
                         "--decode", f"http://127.0.0.1:{decode.http_port}")
    messages = [{"role": "user", "content": "Which path is this?"}]
    answers = []
    for port in (native, http):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        whole = client.chat.completions.create(model="sim", messages=messages, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="sim", messages=messages, max_tokens=24, temperature=0, stream=True) if c.choices)  # type: ignore[arg-type]
        counted = list(client.chat.completions.create(model="sim", messages=messages, max_tokens=24, temperature=0,  # type: ignore[arg-type]
                                                      stream=True, stream_options={"include_usage": True}))
        assert counted[-1].usage is not None and counted[-1].usage.completion_tokens == 24
        answers.append((whole.choices[0].message.content, streamed))
    assert answers[0] == answers[1] and len(answers[0][0] or "") == 24
    # The relay's metrics, as the native path's where it can tell: latency of every answer, TTFT of the
    # streams, tokens from a reply's usage (the stream without include_usage has none).
    figures = [_metrics(port) for port in (native, http)]
    prompt = figures[0]["pd_gateway_prompt_tokens_total"] / 3
    assert prompt > 0 and figures[0]["pd_gateway_generation_tokens_total"] == 72
    assert figures[1]["pd_gateway_e2e_request_latency_seconds_count"] == 3
    assert figures[1]["pd_gateway_time_to_first_token_seconds_count"] == 2
    assert figures[1]["pd_gateway_generation_tokens_total"] == 48
    assert figures[1]["pd_gateway_prompt_tokens_total"] == 2 * prompt
    loads = decode.get("/v1/loads")["loads"]  # type: ignore[index]
    assert loads[0]["max_total_num_tokens"] == 256 * 4 and loads[0]["num_running_reqs"] == 0
    assert decode.get("/get_load") == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
    deadline = time.monotonic() + 10  # the gateway polls /v1/loads after each passed /health probe
    while True:
        workers = httpx.get(f"http://127.0.0.1:{http}/readiness", timeout=10).json()["workers"]
        if all(w["load_fresh"] and w["total_pages"] == 256 * 4 // ROUTING_PAGE_TOKENS for w in workers):
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.2)


def _metrics(port: int) -> dict[str, float]:
    """The gateway's unlabelled samples by name."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    return {name: float(value) for name, _, value in (line.partition(" ") for line in text.splitlines())
            if not name.startswith("#") and "{" not in name}


def test_a_tokenizer_lets_cache_aware_route_sglang_prompts_by_prefix(procs: Procs, tmp_path: Path) -> None:
    """SGLang workers publish no KV events, but with ``--tokenizer`` the gateway matches each prompt against
    the prefixes it sent to each prefill: every tenant's requests stay on one prefill, and new tenants
    spread over both (without a tokenizer cache_aware routes these idle workers by load alone)."""
    logs = [tmp_path / "p0.jsonl", tmp_path / "p1.jsonl"]
    p0, p1 = (start_standin(procs, "prefill", log) for log in logs)
    d = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{p0}", "none", "--prefill", f"http://127.0.0.1:{p1}",
                         "none", "--decode", f"http://127.0.0.1:{d}", "--policy", "cache_aware",
                         "--tokenizer", "byte", "--assume-ttl-s", "600")
    tenants = [f"tenant {t}: " + f"the shared system prompt of tenant number {t}, long enough for pages. " * 4
               for t in range(4)]
    for turn in range(3):
        for prefix in tenants:
            r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=30,
                           json={"text": f"{prefix}question {turn}", "sampling_params": {"max_new_tokens": 4}})
            assert r.status_code == 200, r.text
    served = [{e["text"].split(":")[0] for e in map(json.loads, log.read_text().splitlines() if log.exists() else [])
               if e["event"] == "request"} for log in logs]
    assert served[0].isdisjoint(served[1]), f"a tenant's prompts went to both prefills: {served}"
    assert served[0] and served[1], f"the tenants did not spread over both prefills: {served}"
    assert served[0] | served[1] == {f"tenant {t}" for t in range(4)}


def test_a_mixed_fleet_serves_from_both_kinds(procs: Procs, tmp_path: Path) -> None:
    """Our sim prefill + decode (native) and a stand-in SGLang pair (HTTP) under one gateway: requests go to
    both kinds, each to a pair of its own kind, and every one is answered."""
    sim = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")
    prefill = start_worker(procs, "prefill", *sim, "--bootstrap-embedded", str(free_port()))
    decode = start_worker(procs, "decode", *sim)
    p_log, d_log = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    sp, sd = start_standin(procs, "prefill", p_log), start_standin(procs, "decode", d_log)
    port = start_gateway(procs, "--prefill", prefill.url, f"http://127.0.0.1:{sp}", "9000",
                         "--decode", decode.url, f"http://127.0.0.1:{sd}")
    texts = []
    for _ in range(24):
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=30,
                       json={"text": "mixed", "sampling_params": {"max_new_tokens": 8, "temperature": 0}})
        assert r.status_code == 200, r.text
        texts.append(r.json()["text"])
    relayed = [t for t in texts if t.startswith("decoded ")]
    native = [t for t in texts if not t.startswith("decoded ")]
    assert relayed and native, "both kinds served"
    assert len(set(native)) == 1 and len(native[0]) == 8, "our workers: the same greedy answer each time"
    standin_rooms = {json.loads(line)["bootstrap_room"] for line in d_log.read_text().splitlines()}
    assert {int(t.split()[1]) for t in relayed} <= standin_rooms
    assert len(decode.get("/debug/rooms")) == len(native)  # type: ignore[arg-type]
    body = httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=10).json()
    assert body["ready"] and len(body["workers"]) == 4


def test_a_client_leaving_the_queue_gives_up_its_place(procs: Procs, tmp_path: Path) -> None:
    """One slot, one queue place, in front of SGLang workers: a queued client that closes its connection
    leaves the queue then, so the next one queues instead of getting a 429."""
    import asyncio

    p, d = start_standin(procs, "prefill", tmp_path / "p.jsonl"), start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{p}", "none", "--decode", f"http://127.0.0.1:{d}",
                         "--max-concurrent-requests", "1", "--max-queued-requests", "1", "--queue-timeout-s", "30")

    async def run() -> tuple[int, int]:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            first = asyncio.create_task(http.post("/generate", json={"text": "DECODE_SLOW_HEAD"}))  # 2 s
            await asyncio.sleep(0.5)
            payload = json.dumps({"text": "queued, then gone"}).encode()
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /generate HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (len(payload), payload))
            await writer.drain()
            await asyncio.sleep(0.3)
            writer.close()
            await asyncio.sleep(0.3)
            third = await http.post("/generate", json={"text": "third"})
            return (await first).status_code, third.status_code

    assert asyncio.run(run()) == (200, 200)
    texts = [json.loads(line)["text"] for line in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert "queued, then gone" not in texts, "the client that left was never relayed"


@pytest.mark.parametrize(("argv", "error"), [
    (["--prefill", "http://127.0.0.1:1", "--decode", "pd://127.0.0.1:2"], "one prefill and one decode of their kind"),
    (["--prefill", "pd://127.0.0.1:1", "8998", "--decode", "pd://127.0.0.1:2"], "follows only an SGLang"),
    (["--prefill", "8998", "--decode", "pd://127.0.0.1:2"], "must follow a prefill URL"),
    (["--worker", "http://127.0.0.1:1"], "run disaggregated"),
    (["--prefill", "pd://127.0.0.1:1", "--decode", "127.0.0.1:1/"], "listed twice"),  # one worker, two spellings
    (["--prefill", "pd://127.0.0.1:1/x", "--decode", "pd://127.0.0.1:2"], "must look like pd://HOST:PORT"),
    (["--prefill", "http://admin:s3cret@127.0.0.1:1", "--decode", "http://127.0.0.1:2"], "must not carry credentials"),
])
def test_bad_sglang_worker_flags_are_refused(argv: list[str], error: str) -> None:
    from gateway.cli import build_parser, config_from_args

    with pytest.raises(ValueError, match=error):
        config_from_args(build_parser().parse_args(argv))


def test_sglang_cli_form_is_parsed() -> None:
    from gateway.cli import build_parser, config_from_args

    config = config_from_args(build_parser().parse_args([
        "--pd-disaggregation", "--prefill", "http://a:30000", "8998", "--prefill", "http://b:30000", "none",
        "--prefill", "http://c:30000", "--decode", "http://d:30001", "pd://e:1", "--prefill", "pd://f:2"]))
    assert config.prefill == ("http://a:30000", "http://b:30000", "http://c:30000", "pd://f:2")
    assert config.prefill_bootstrap_ports == (8998, None, None, None)
    assert config.decode == ("http://d:30001", "pd://e:1")


def test_breakers_count_worker_failures_not_bad_requests(procs: Procs, tmp_path: Path) -> None:
    sp = start_standin(procs, "prefill", tmp_path / "p.jsonl")
    sd = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{sp}", "--decode", f"http://127.0.0.1:{sd}",
                         "--max-retries", "0", "--breaker-failures", "2", "--breaker-cooldown-s", "60")
    url = f"http://127.0.0.1:{port}/generate"
    for _ in range(4):  # the request's fault: the workers stay selectable
        assert httpx.post(url, json={"text": "PREFILL_400"}, timeout=30).status_code == 400
    assert httpx.post(url, json={"text": "fine"}, timeout=30).status_code == 200
    # Its routes relay to SGLang workers: a native worker added now would get no traffic; refused.
    r = httpx.post(f"http://127.0.0.1:{port}/add_worker", params={"url": "pd://127.0.0.1:1", "role": "decode"})
    assert r.status_code == 400 and "SGLang" in r.json()["error"]["message"], r.text
    assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).status_code == 200
    for _ in range(3):  # a busy decode is no failure of its own; the client is told to come back when it said
        r = httpx.post(url, json={"text": "DECODE_429"}, timeout=30)
        assert r.status_code == 429 and r.headers.get("retry-after") == "7", (r.headers, r.text)
        assert r.json()["error"]["type"] == "rate_limit_error" and "429" in r.json()["error"]["message"]
    assert httpx.post(url, json={"text": "fine"}, timeout=30).status_code == 200
    for _ in range(3):  # nor is a full one (its request queue: SGLang's 503), answered as the worker's 503
        r = httpx.post(url, json={"text": "DECODE_503"}, timeout=30)
        assert r.status_code == 503 and r.headers.get("retry-after") == "7", (r.headers, r.text)
    assert httpx.post(url, json={"text": "fine"}, timeout=30).status_code == 200
    for _ in range(2):
        assert httpx.post(url, json={"text": "DECODE_500"}, timeout=30).status_code == 502
    r = httpx.post(url, json={"text": "fine"}, timeout=30)
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text
    workers = httpx.get(f"http://127.0.0.1:{port}/readiness", timeout=10).json()["workers"]
    assert {w["role"]: w["breaker"] for w in workers} == {"prefill": "closed", "decode": "open"}


def test_a_decode_silent_after_its_prefill_finished_counts_against_it(procs: Procs, tmp_path: Path) -> None:
    """A stream whose decode sends nothing within the first-token timeout, its prefill done: the
    decode's failure (two open its breaker); while a prefill still works, nobody's."""
    sp = start_standin(procs, "prefill", tmp_path / "p.jsonl")
    sd = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{sp}", "--decode", f"http://127.0.0.1:{sd}",
                         "--max-retries", "0", "--breaker-failures", "2", "--breaker-cooldown-s", "60",
                         "--first-token-timeout-s", "0.5")
    url = f"http://127.0.0.1:{port}/generate"
    for _ in range(2):
        r = httpx.post(url, json={"text": "DECODE_WAITS", "stream": True}, timeout=30)
        assert r.status_code == 504, r.text
    r = httpx.post(url, json={"text": "fine"}, timeout=30)
    assert r.status_code == 503 and "decode" in r.json()["error"]["message"], r.text


def test_requests_cut_by_the_drain_timeout_are_told_why(tmp_path: Path) -> None:
    """SIGTERM, and requests still open when ``--drain-timeout-s`` passes: a relayed stream ends with an
    error event and ``[DONE]``, a whole answer not begun is a 503 (the connection was closed mid-body)."""
    import concurrent.futures
    import signal

    procs = Procs(tmp_path)
    try:
        p = start_standin(procs, "prefill", tmp_path / "p.jsonl")
        d = start_standin(procs, "decode", tmp_path / "d.jsonl")
        port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{p}", "none", "--decode", f"http://127.0.0.1:{d}",
                             "--drain-timeout-s", "1")
        gateway = next(proc for proc in procs.procs if getattr(proc, "name", "").startswith("gateway-"))
        url = f"http://127.0.0.1:{port}/generate"
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(httpx.post, url, json={"text": "DECODE_WAITS"}, timeout=30)
            with httpx.stream("POST", url, json={"text": "DECODE_LONG", "stream": True}, timeout=30) as r:
                lines = r.iter_lines()
                assert next(lines) == 'data: {"text": "one"}'
                time.sleep(0.3)  # (the whole one is at its decode too)
                gateway.send_signal(signal.SIGTERM)
                events = [line[6:] for line in lines if line.startswith("data: ")]
            cut = whole.result()
        assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "shutting_down", events
        assert cut.status_code == 503 and cut.json()["error"]["code"] == "shutting_down", cut.text
        assert gateway.wait(30) in (0, -signal.SIGTERM)
    finally:
        procs.stop_all()


def test_a_worker_api_key_goes_with_every_request_to_the_workers(procs: Procs, tmp_path: Path) -> None:
    """SGLang workers started with ``--api-key``: the gateway's probes, model look-up and relayed
    requests all carry ``--worker-api-key`` (here from a file); a gateway without it routes nothing to
    them and says why."""
    key = "sk-workers-" + os.urandom(6).hex()
    p_log, d_log = tmp_path / "p.jsonl", tmp_path / "d.jsonl"
    sp, sd = start_standin(procs, "prefill", p_log, key), start_standin(procs, "decode", d_log, key)
    key_file = tmp_path / "worker.key"
    key_file.write_text(f"# the SGLang workers' --api-key\n{key}\n")
    workers = ["--prefill", f"http://127.0.0.1:{sp}", "--decode", f"http://127.0.0.1:{sd}", "--max-retries", "0",
               "--health-interval-s", "0.2"]
    port = start_gateway(procs, *workers, "--worker-api-key-file", str(key_file))
    base = f"http://127.0.0.1:{port}"
    r = httpx.post(f"{base}/generate", json={"text": "hello"}, timeout=30)
    assert r.status_code == 200 and r.json()["text"].startswith("decoded "), r.text
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused")
    chunks = list(client.chat.completions.create(model="standin-model", stream=True,
                                                 messages=[{"role": "user", "content": "hi"}]))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("decoded")
    assert client.models.list().data[0].id == "standin-model"  # (learned from /get_model_info, with the key)
    for log in (p_log, d_log):
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        assert [e for e in entries if e["event"] == "request"], "each worker served requests"
        assert not [e for e in entries if e["event"] == "unauthorized"], entries
    assert key not in httpx.get(f"{base}/readiness", timeout=10).text

    # Without the key: every probe is refused, no pair is ready, requests are a 503 naming the cause.
    other = free_port()
    gateway = procs.start(f"gateway-{other}", "-m", "gateway.cli", "--port", str(other), "--log-level", "warning",
                          "--startup-timeout-s", "1", *workers)
    wait_http_ok(f"http://127.0.0.1:{other}/health", 60, gateway)
    ready = httpx.get(f"http://127.0.0.1:{other}/readiness", timeout=10)
    assert ready.status_code == 503, ready.text
    assert all("401" in w["error"] and "--worker-api-key" in w["error"] for w in ready.json()["workers"]), ready.text
    r = httpx.post(f"http://127.0.0.1:{other}/generate", json={"text": "hello"}, timeout=30)
    assert r.status_code == 503, r.text


@pytest.mark.parametrize("scheme", ["http", "pd"])
def test_bad_worker_api_keys_are_refused(scheme: str) -> None:
    """A key that cannot go in a header (or a handshake) is refused at start-up; native (pd://) workers take
    the key too (their --api-key), SGLang ones as before."""
    from gateway.cli import build_parser, config_from_args

    workers = ["--prefill", f"{scheme}://127.0.0.1:1", "--decode", f"{scheme}://127.0.0.1:2"]
    with pytest.raises(ValueError, match="white space"):
        config_from_args(build_parser().parse_args(["--worker-api-key", "two words", *workers]))
    assert config_from_args(build_parser().parse_args(["--worker-api-key", "k", *workers])).worker_api_key == "k"


def test_the_admin_api_adds_and_drains_sglang_workers(procs: Procs, tmp_path: Path) -> None:
    """SGLang (http://) workers join and leave through the admin API as native ones do, a prefill with its
    bootstrap port (SGLang router's ``/add_worker?...&bootstrap_port=N`` too): requests reach the new one
    with its port; one removed gets no more."""
    logs = [tmp_path / "p0.jsonl", tmp_path / "p1.jsonl"]
    p0 = start_standin(procs, "prefill", logs[0])
    d = start_standin(procs, "decode", tmp_path / "d.jsonl")
    port = start_gateway(procs, "--pd-disaggregation", "--prefill", f"http://127.0.0.1:{p0}", "7001",
                         "--decode", f"http://127.0.0.1:{d}", "--health-interval-s", "0.2")
    fleet = Fleet(f"http://127.0.0.1:{port}", logs, tmp_path / "d.jsonl", [7001, 7002])
    admin = f"{fleet.base_url}/workers"
    p1 = start_standin(procs, "prefill", logs[1])
    new = f"http://127.0.0.1:{p1}"
    for body, param in (({"url": new, "role": "both"}, "role"),
                        ({"url": new, "role": "decode", "bootstrap_port": 7003}, "bootstrap_port"),
                        ({"url": f"http://127.0.0.1:{d}", "role": "decode"}, "url"),  # (there already: 409)
                        ({"url": "pd://127.0.0.1:1", "role": "prefill", "bootstrap_port": 7003}, "bootstrap_port")):
        refused = httpx.post(admin, json=body, timeout=10)
        assert refused.status_code in (400, 409) and refused.json()["error"]["param"] == param, refused.text
    for odd in ("x", "\u00b2", "\u0661\u0662", "9" * 5000):  # (str.isdigit takes the superscript and Arabic-Indic)
        bad_port = httpx.post(f"{fleet.base_url}/add_worker", params={"url": new, "worker_type": "prefill",
                                                                      "bootstrap_port": odd}, timeout=10)
        assert bad_port.status_code == 400 and bad_port.json()["error"]["param"] == "bootstrap_port", bad_port.text
    added = httpx.post(f"{fleet.base_url}/add_worker", params={"url": new, "worker_type": "prefill",
                                                               "bootstrap_port": "7002"}, timeout=10)
    assert added.status_code == 201, added.text
    again = httpx.post(admin, json={"url": new + "/", "role": "prefill"}, timeout=10)
    assert again.status_code == 409, again.text

    def listed() -> dict[str, dict]:  # type: ignore[type-arg]
        return {w["url"]: w for w in httpx.get(admin, timeout=10).json()["workers"]}

    deadline = time.monotonic() + 10
    while not listed()[new]["healthy"]:
        assert time.monotonic() < deadline, listed()
        time.sleep(0.1)
    rooms = [int(post(fleet, "/generate", {"text": "turns"}).json()["text"].split()[1]) for _ in range(6)]
    ports = {fleet.prefill_port_of(room)[0] for room in rooms}
    assert ports == {7001, 7002}, ports  # (round robin: both prefills, each with its own bootstrap port)

    old = f"http://127.0.0.1:{p0}"
    removed = httpx.delete(admin, params={"url": old}, timeout=10)
    assert removed.status_code == 202 and removed.json()["draining"] is True, removed.text
    deadline = time.monotonic() + 10
    while old in listed():
        assert time.monotonic() < deadline, listed()
        time.sleep(0.1)
    rooms = [int(post(fleet, "/generate", {"text": "after"}).json()["text"].split()[1]) for _ in range(4)]
    assert {fleet.prefill_port_of(room)[0] for room in rooms} == {7002}
    assert httpx.post(f"{fleet.base_url}/remove_worker", params={"url": old}, timeout=10).status_code == 404
