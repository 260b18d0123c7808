"""The PD path through real processes: bootstrap, prefill and decode sim workers, gateway, openai client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import openai
import pytest
from sim_reference import expected_tokens, text_of

PROMPT = [ord(c) for c in "The KV cache of this prompt crosses two processes."]


def client(cluster) -> openai.OpenAI:  # type: ignore[no-untyped-def]
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_pd_path_moves_the_exact_kv_and_output_depends_on_it(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    out = c.completions.create(model="sim", prompt=PROMPT, max_tokens=12)
    assert out.choices[0].text == text_of(expected_tokens(PROMPT, 12))
    assert out.usage is not None and out.usage.prompt_tokens == len(PROMPT) and out.usage.completion_tokens == 12

    (p_room,) = cluster.prefills[0].get("/debug/rooms")
    (d_room,) = cluster.decodes[0].get("/debug/rooms")
    assert p_room["room"] == d_room["room"], "both workers must have served the same bootstrap room"
    assert d_room["kv_verified"] is True, "the decode checked its pages against the prompt"
    assert d_room["kv_digest"] == p_room["kv_digest"], "decode holds exactly the bytes the prefill computed"
    assert d_room["first_token"] == p_room["first_token"]
    cluster.wait_pools_full()


def test_one_token_requests_finish_at_the_kv_import(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """max_tokens=1: the decode's only token is the one the prefill sampled, so the request ends the
    moment its KV arrives (a regression: the decode recorded the room after freeing its pages, and
    its scheduler loop died)."""
    cluster = sim_cluster()
    c = client(cluster)
    for _ in range(3):
        out = c.completions.create(model="sim", prompt=PROMPT, max_tokens=1)
        assert out.choices[0].text == text_of(expected_tokens(PROMPT, 1))
        assert out.choices[0].finish_reason == "length"
    d_rooms = cluster.decodes[0].get("/debug/rooms")
    assert len(d_rooms) == 3 and all(r["kv_verified"] for r in d_rooms)
    assert cluster.decodes[0].get("/health")["status"] == "ok"
    assert c.completions.create(model="sim", prompt=PROMPT, max_tokens=4).choices[0].text == text_of(
        expected_tokens(PROMPT, 4))
    cluster.wait_pools_full()


def _transfer_skip(name: str) -> str | None:
    """The backend's own reason it cannot run here (``unavailable_reason()``: a missing library,
    Mooncake's private network namespace), or None."""
    from transfer.registry import load_backend

    check = getattr(load_backend(name), "unavailable_reason", None)
    return check() if check is not None else None


@pytest.mark.parametrize("transfer", ["tcp", "mooncake", "nixl"])
def test_pd_path_over_each_transfer_backend(sim_cluster, transfer: str) -> None:  # type: ignore[no-untyped-def]
    reason = _transfer_skip(transfer)
    if reason:
        pytest.skip(reason)
    # the same-host path off: this backend's own bytes cross the loopback
    cluster = sim_cluster(transfer=transfer, env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"},
                          worker_args=("--same-host-kv", "off"))
    c = client(cluster)
    long_prompt = PROMPT * 5  # several pages, several chunks
    for prompt in (PROMPT, long_prompt):
        out = c.completions.create(model="sim", prompt=prompt, max_tokens=10)
        assert out.choices[0].text == text_of(expected_tokens(prompt, 10))
    p_rooms = {r["room"]: r for r in cluster.prefills[0].get("/debug/rooms")}  # type: ignore[attr-defined]
    for d_room in cluster.decodes[0].get("/debug/rooms"):  # type: ignore[attr-defined]
        assert d_room["kv_verified"] is True
        assert d_room["kv_digest"] == p_rooms[d_room["room"]]["kv_digest"]
    metrics = httpx.get(f"http://127.0.0.1:{cluster.prefills[0].http_port}/metrics", timeout=10).text
    assert f'pd_worker_kv_peers{{path="{transfer}",role="prefill"}} 1.0' in metrics, metrics
    assert 'pd_worker_kv_peers{path="shm",role="prefill"} 0.0' in metrics, "--same-host-kv off: no shm"
    cluster.wait_pools_full()


def test_pd_path_through_shared_memory_on_one_host(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """Workers on one host (the default --same-host-kv auto): the prefill proves it maps the decode's
    pool and copies the KV into it; the bytes are exact; the prefill counts its decode under path shm."""
    cluster = sim_cluster()
    c = client(cluster)
    for prompt in (PROMPT, PROMPT * 5):
        out = c.completions.create(model="sim", prompt=prompt, max_tokens=10)
        assert out.choices[0].text == text_of(expected_tokens(prompt, 10))
    p_rooms = {r["room"]: r for r in cluster.prefills[0].get("/debug/rooms")}  # type: ignore[attr-defined]
    for d_room in cluster.decodes[0].get("/debug/rooms"):  # type: ignore[attr-defined]
        assert d_room["kv_verified"] is True and d_room["kv_digest"] == p_rooms[d_room["room"]]["kv_digest"]
    metrics = httpx.get(f"http://127.0.0.1:{cluster.prefills[0].http_port}/metrics", timeout=10).text
    assert 'pd_worker_kv_peers{path="shm",role="prefill"} 1.0' in metrics, metrics
    assert 'pd_worker_kv_peers{path="tcp",role="prefill"} 0.0' in metrics
    cluster.wait_pools_full()


def test_output_changes_when_the_prefill_computes_other_kv(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(prefill_args=("--engine-option", "kv_salt=7"))
    out = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=12)
    assert out.choices[0].text == text_of(expected_tokens(PROMPT, 12, prefill_salt=7))
    assert out.choices[0].text != text_of(expected_tokens(PROMPT, 12))
    (d_room,) = cluster.decodes[0].get("/debug/rooms")
    assert d_room["kv_verified"] is False
    cluster.wait_pools_full()


def test_pd_path_with_kv_verification_off(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(worker_args=("--engine-option", "verify_kv=0"))
    out = client(cluster).completions.create(model="sim", prompt=PROMPT, max_tokens=12)
    assert out.choices[0].text == text_of(expected_tokens(PROMPT, 12, verify_kv=False))
    (p_room,) = cluster.prefills[0].get("/debug/rooms")
    (d_room,) = cluster.decodes[0].get("/debug/rooms")
    assert d_room["kv_verified"] is None and d_room["kv_digest"] is None, "nothing checked: reported as such"
    assert d_room["first_token"] == p_room["first_token"]
    cluster.wait_pools_full()


def test_openai_chat_stream_and_non_stream(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = c.chat.completions.create(model="sim", messages=messages, max_tokens=20)  # type: ignore[arg-type]
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason == "length"
    chunks = list(c.chat.completions.create(model="sim", messages=messages, max_tokens=20, stream=True,  # type: ignore[arg-type]
                                            stream_options={"include_usage": True}))
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == text, "greedy sim output is deterministic across stream and non-stream"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 20
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    cluster.wait_pools_full()


def test_concurrent_requests_over_two_pairs(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=2, num_decode=2)

    async def run() -> list[str]:
        ac = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        prompts = [[*PROMPT, 65 + i] for i in range(24)]
        outs = await asyncio.gather(*(ac.completions.create(model="sim", prompt=p, max_tokens=8) for p in prompts))
        await ac.close()
        for p, o in zip(prompts, outs, strict=True):
            assert o.choices[0].text == text_of(expected_tokens(p, 8))
        return [o.choices[0].text for o in outs]

    asyncio.run(run())
    rooms = [r["room"] for w in cluster.prefills for r in w.get("/debug/rooms")]  # type: ignore[attr-defined]
    assert len(rooms) == 24 and len(set(rooms)) == 24, "a fresh room per request"
    assert all(w.get("/debug/rooms") for w in cluster.workers()), "round robin used every worker"
    cluster.wait_pools_full()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        (b'{"prompt": "hi", "max_tokens": "many"}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": -3}', "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": 10000000000}', "max_tokens"),
        (b'{"prompt": "", "max_tokens": 4}', "prompt"),
        (b'{"prompt": "hi", "temperature": "hot"}', "temperature"),
        (b'{"prompt": "hi", "n": 0}', "n"),
        (b'{"prompt": [1, "x"]}', "prompt"),
        (b'{"prompt": "hi", "stop_token_ids": [100000], "min_tokens": 2}', "stop_token_ids"),  # (vocab: 258)
    ],
)
def test_bad_input_is_a_clear_400_and_loses_nothing(sim_cluster, body: bytes, param: str | None) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    r = httpx.post(f"{cluster.base_url}/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    ok = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200
    cluster.wait_pools_full()


def test_decode_killed_mid_stream_ends_the_request_and_frees_prefill(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.05"))
    c = client(cluster)
    stream = c.completions.create(model="sim", prompt=PROMPT, max_tokens=400, stream=True)
    first = next(iter(stream))
    assert first.choices[0].text
    os.kill(cluster.decodes[0].proc.pid, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert time.monotonic() - started < 30
    assert "decode" in str(info.value)
    load = cluster.prefills[0].get("/load")
    assert load["num_free_pages"] == load["num_total_pages"]  # type: ignore[index]
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"


def test_prefill_killed_before_transfer_fails_fast_and_frees_decode(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(prefill_args=("--engine-option", "prefill_token_s=0.2", "--chunk-size", "4"))
    c = client(cluster)
    started = time.monotonic()

    def kill_soon() -> None:
        time.sleep(1.0)
        os.kill(cluster.prefills[0].proc.pid, signal.SIGKILL)

    import threading

    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(openai.APIError):
        c.completions.create(model="sim", prompt=PROMPT, max_tokens=4)
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 20
    while True:
        load = cluster.decodes[0].get("/load")
        if load["num_free_pages"] == load["num_total_pages"]:  # type: ignore[index]
            break
        assert time.monotonic() < deadline, f"decode pages not returned: {load}"
        time.sleep(0.1)


def test_client_disconnect_mid_stream_frees_both_sides(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.02"))
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", timeout=30,
                      json={"prompt": "hello", "max_tokens": 500, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    cluster.wait_pools_full()
    assert not any(w.get("/load")["num_running"] for w in cluster.workers())  # type: ignore[index]


def test_registry_embedded_in_the_prefill_worker(procs) -> None:  # type: ignore[no-untyped-def]
    from pdtest import free_port, start_gateway, start_worker

    boot_port = free_port()
    common = ("--engine", "sim", "--num-pages", "64", "--page-size", "4")
    # (a heartbeat interval past the registry's 10 s lease: the registration is still renewed in time)
    prefill = start_worker(procs, "prefill", *common, "--bootstrap-embedded", str(boot_port),
                           "--heartbeat-interval-s", "30")
    decode = start_worker(procs, "decode", *common, bootstrap=f"http://127.0.0.1:{boot_port}")
    port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    out = c.completions.create(model="sim", prompt=PROMPT, max_tokens=6)
    assert out.choices[0].text == text_of(expected_tokens(PROMPT, 6))
    topology = httpx.get(f"http://127.0.0.1:{boot_port}/route", params={
        "prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}).json()
    assert topology["page_size"] == 4

    def registrations() -> float:
        metrics = httpx.get(f"http://127.0.0.1:{boot_port}/metrics", timeout=10).text
        return sum(float(line.split()[-1]) for line in metrics.splitlines()
                   if line.startswith("bootstrap_rank_registrations"))

    first, deadline = registrations(), time.monotonic() + 10
    while registrations() <= first:
        assert time.monotonic() < deadline, "the prefill did not renew its registration within 10 s"
        time.sleep(0.2)


def test_stop_strings_n_choices_and_generate_stream(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.005"))
    c = client(cluster)
    full = text_of(expected_tokens(PROMPT, 40))
    stop = full[10:13]
    cut = full[: full.index(stop)]
    out = c.completions.create(model="sim", prompt=PROMPT, max_tokens=40, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = c.completions.create(model="sim", prompt=PROMPT, max_tokens=40, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == cut
    for stream in (False, True):  # vLLM's include_stop_str_in_output: the text ends with the stop string
        kept = httpx.post(f"{cluster.base_url}/v1/completions", timeout=30, json={
            "prompt": PROMPT, "max_tokens": 40, "stop": [stop], "include_stop_str_in_output": True, "stream": stream})
        assert kept.status_code == 200, kept.text
        text = kept.json()["choices"][0]["text"] if not stream else "".join(
            json.loads(line[6:])["choices"][0]["text"] for line in kept.text.splitlines()
            if line.startswith("data: {") and json.loads(line[6:])["choices"])
        assert text == cut + stop
    # with logprobs: one entry per token, also for tokens whose text a possible stop string holds back
    chunks = list(c.completions.create(model="sim", prompt=PROMPT, max_tokens=12, stop=["@@never@@"], logprobs=1,
                                       stream=True))
    tokens = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens or []]
    assert len(tokens) == 12 and "".join(tokens) == full[:12], tokens
    # The decode ended all four itself at the token completing the stop string (not aborted by the gateway
    # later), so a whole response could be gathered (``Submit.gather_s``).
    metrics = httpx.get(f"http://127.0.0.1:{cluster.decodes[0].http_port}/metrics", timeout=10).text
    stopped = [line for line in metrics.splitlines()
               if line.startswith("pd_worker_requests_finished") and 'reason="stop"' in line]
    assert stopped and float(stopped[0].rsplit(" ", 1)[1]) == 4, stopped

    many = c.completions.create(model="sim", prompt=PROMPT, max_tokens=5, n=3)
    assert sorted(ch.index for ch in many.choices) == [0, 1, 2]
    assert {ch.text for ch in many.choices} == {full[:5]}
    assert many.usage is not None and many.usage.completion_tokens == 15

    events = []
    with httpx.stream("POST", f"{cluster.base_url}/generate", timeout=30,
                      json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 6}, "stream": True}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["text"] == full[:6] and last["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    # A batch may name its items (``rid`` as a list, as SGLang takes it): each answer carries its own id.
    batch = {"input_ids": [PROMPT, PROMPT[:-1]], "rid": ["a", "b"], "sampling_params": {"max_new_tokens": 3}}
    answers = httpx.post(f"{cluster.base_url}/generate", json=batch, timeout=30).json()
    assert [a["meta_info"]["id"] for a in answers] == ["a", "b"], answers
    refused = httpx.post(f"{cluster.base_url}/generate", json={**batch, "rid": ["a"]}, timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "rid", refused.text
    # Unnamed, each item gets its own id (as SGLang gives them); one id for the whole batch names them
    # "<rid>_<i>" (SGLang's ``GenerateReqInput._normalize_rid``), streamed or not.
    unnamed = httpx.post(f"{cluster.base_url}/generate", json={**batch, "rid": None}, timeout=30).json()
    assert len({a["meta_info"]["id"] for a in unnamed}) == 2, unnamed
    one = httpx.post(f"{cluster.base_url}/generate", json={**batch, "rid": "one"}, timeout=30)
    assert [a["meta_info"]["id"] for a in one.json()] == ["one_0", "one_1"], one.text
    with httpx.stream("POST", f"{cluster.base_url}/generate", timeout=30,
                      json={**batch, "rid": "one", "stream": True}) as r:
        ids = {json.loads(line[6:])["meta_info"]["id"] for line in r.iter_lines()
               if line.startswith("data: {")}
    assert ids == {"one_0", "one_1"}, ids
    # text and input_ids both: which is the prompt? A 400 (as SGLang's), not input_ids silently.
    both = httpx.post(f"{cluster.base_url}/generate", json={"text": "hi", "input_ids": PROMPT}, timeout=30)
    assert both.status_code == 400 and both.json()["error"]["param"] == "input_ids", both.text
    cluster.wait_pools_full()


def test_client_hanging_up_on_a_non_streaming_request_aborts_it(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(decode_args=("--engine-option", "decode_step_s=0.05"))  # 500 tokens: ~25 s
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "hello", "max_tokens": 500}, timeout=1.5)
    deadline = time.monotonic() + 5
    while cluster.decodes[0].get("/load")["num_running"]:  # type: ignore[index]
        assert time.monotonic() < deadline, "the decode kept generating for a client that left"
        time.sleep(0.1)
    cluster.wait_pools_full(timeout_s=5)


def test_stream_abandoned_before_the_first_token_is_aborted(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(prefill_args=("--engine-option", "prefill_token_s=0.05", "--chunk-size", "8"))
    with pytest.raises(httpx.TimeoutException), httpx.stream(
        "POST", f"{cluster.base_url}/v1/completions", timeout=1.5,
        json={"prompt": "x" * 200, "max_tokens": 4, "stream": True},  # ~10 s of prefill
    ) as r:
        r.read()
    deadline = time.monotonic() + 5
    while cluster.prefills[0].get("/load")["num_running"]:  # type: ignore[index]
        assert time.monotonic() < deadline, "the prefill kept computing for a client that left"
        time.sleep(0.1)
    cluster.wait_pools_full(timeout_s=5)
