"""SGLang's own router in front of our workers, over SGLang's HTTP PD protocol (``workers/sglang_api.py``).

``sglang-router`` is installed from the package index into a temporary directory (the test skips,
saying why, only if that fails). Its Rust router and its Python ``--mini-lb`` each run in PD mode in
front of one sim prefill (registry embedded, ``--prefill URL PORT``) and one sim decode; our own
gateway runs in front of the same two workers over the native protocol. For greedy (and seeded)
requests every route, streamed or not, must give what our gateway gives for the same prompt.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from pdtest import Procs, Worker, free_port, start_gateway, start_worker, wait_http_ok

SGLANG_ROUTER = "sglang-router==0.3.2"
SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")
MESSAGES = [{"role": "user", "content": "Tell me about disaggregated serving."}]
PROMPT = "Prefill and decode run on separate workers, and"


@dataclass
class Stack:
    prefill: Worker
    decode: Worker
    gateway: str  # our gateway, native protocol
    routers: dict[str, str]  # "rust" / "mini_lb" -> base URL

    def pools_full(self) -> bool:
        return all(w.get("/load")["num_free_pages"] == w.get("/load")["num_total_pages"]  # type: ignore[index]
                   for w in (self.prefill, self.decode))


@pytest.fixture(scope="module")
def router_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where ``sglang_router`` is importable from: ``make install`` puts it in ``.venv/sglang-router``
    (tests run in a network namespace without the package index); else pip installs it here."""
    installed = Path(sys.prefix) / "sglang-router"
    if (installed / "sglang_router").is_dir():
        return installed
    target = tmp_path_factory.mktemp("sglang-router")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                           "--target", str(target), SGLANG_ROUTER], capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        pytest.skip(f"cannot install {SGLANG_ROUTER} from the package index: {proc.stderr.strip()[-400:]}")
    return target


def start_router(procs: Procs, site: Path, prefill: Worker, bootstrap_port: int, decode: Worker,
                 *extra: str) -> str:
    port = free_port()
    name = f"sglang-router-{port}"
    proc = procs.start(name, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                       "--prefill", f"http://127.0.0.1:{prefill.http_port}", str(bootstrap_port),
                       "--decode", f"http://127.0.0.1:{decode.http_port}",
                       "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
                       # its metrics exporter: a port of its own (the default one is shared by every router)
                       "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *extra,
                       env={"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1", "NO_PROXY": "*"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http_ok(f"{url}/health", 60, proc)
        deadline = time.monotonic() + 30  # the Rust router marks workers healthy after its first checks
        while True:
            reply = httpx.post(f"{url}/generate", json={"text": "warm", "sampling_params": {"max_new_tokens": 1}},
                               timeout=30)
            if reply.status_code == 200 or time.monotonic() > deadline:
                reply.raise_for_status()
                break
            time.sleep(0.2)
    except Exception as exc:
        raise RuntimeError(f"SGLang router did not start: {exc}\n{procs.log(name)[-3000:]}") from exc
    return url


@pytest.fixture(scope="module")
def stack(router_site: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    procs = Procs(tmp_path_factory.mktemp("sglang-stack"))
    try:
        bootstrap_port = free_port()
        prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
        decode = start_worker(procs, "decode", *SIM)
        gateway = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
        routers = {
            "rust": start_router(procs, router_site, prefill, bootstrap_port, decode),
            "mini_lb": start_router(procs, router_site, prefill, bootstrap_port, decode, "--mini-lb"),
        }
        yield Stack(prefill, decode, f"http://127.0.0.1:{gateway}", routers)
    finally:
        procs.stop_all()


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=30)


def chat(base_url: str, stream: bool, **extra: object) -> list[str]:
    c = client(base_url)
    if not stream:
        out = c.chat.completions.create(model="sim", messages=MESSAGES, **extra)  # type: ignore[call-overload]
        return [choice.message.content for choice in sorted(out.choices, key=lambda ch: ch.index)]
    texts: dict[int, str] = {}
    for chunk in c.chat.completions.create(model="sim", messages=MESSAGES, stream=True,  # type: ignore[call-overload]
                                           **extra):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
    return [texts[i] for i in sorted(texts)]


def completion(base_url: str, stream: bool) -> str:
    c = client(base_url)
    if not stream:
        return c.completions.create(model="sim", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    return "".join(chunk.choices[0].text for chunk in
                   c.completions.create(model="sim", prompt=PROMPT, max_tokens=24, temperature=0, stream=True)
                   if chunk.choices)


def generate(base_url: str, stream: bool) -> tuple[str, list[int]]:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 20, "temperature": 0}, "stream": stream}
    if not stream:
        reply = httpx.post(f"{base_url}/generate", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        out = reply.json()
        return out["text"], out["output_ids"]
    last = None
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=30) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                last = json.loads(line[6:])  # cumulative: the last event holds everything
    assert last is not None, "no events"
    return last["text"], last["output_ids"]


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_equals_our_gateway(stack: Stack, router: str, stream: bool) -> None:
    want = chat(stack.gateway, stream, max_tokens=32, temperature=0)
    got = chat(stack.routers[router], stream, max_tokens=32, temperature=0)
    assert len(want[0]) == 32, "the sim engine emits one character per token"
    assert got == want


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completions_equal_our_gateway(stack: Stack, router: str, stream: bool) -> None:
    want = completion(stack.gateway, stream)
    assert len(want) == 24
    assert completion(stack.routers[router], stream) == want


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_generate_equals_our_gateway(stack: Stack, router: str, stream: bool) -> None:
    want = generate(stack.gateway, stream)
    assert len(want[1]) == 20
    assert generate(stack.routers[router], stream) == want


def generate_batch(base_url: str, stream: bool, batch: dict[str, object]) -> list[list[int]]:
    """Each item's output ids of a batched ``/generate`` (a list; streamed, events naming their ``index``)."""
    body = {**batch, "sampling_params": {"max_new_tokens": 12, "temperature": 0}, "stream": stream}
    if not stream:
        reply = httpx.post(f"{base_url}/generate", json=body, timeout=30)
        assert reply.status_code == 200, reply.text
        return [item["output_ids"] for item in reply.json()]
    last: dict[int, list[int]] = {}
    with httpx.stream("POST", f"{base_url}/generate", json=body, timeout=30) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                last[event["index"]] = event["output_ids"]  # (cumulative per item)
    return [last[i] for i in sorted(last)]


@pytest.mark.parametrize("router", ["rust", "mini_lb", "gateway"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_batched_generate_answers_each_item(stack: Stack, router: str, stream: bool) -> None:
    """SGLang's routers send batches (lists of token id lists; mini_lb lists of texts too) with a list of
    bootstrap fields: each item is answered as the same prompt alone would be."""
    texts = ["Prefill first,", "then the decode worker carries on with"]
    alone = [httpx.post(f"{stack.gateway}/generate", timeout=30, json={
        "text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}).json()["output_ids"]
        for text in texts]
    base = stack.gateway if router == "gateway" else stack.routers[router]
    assert generate_batch(base, stream, {"input_ids": [list(t.encode()) for t in texts]}) == alone
    if router != "rust":  # (the Rust router itself refuses a list of texts: 422)
        assert generate_batch(base, stream, {"text": texts}) == alone


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
def test_several_choices_each_get_their_own_room(stack: Stack, router: str) -> None:
    """n=2: the Rust router sends a room per choice, mini_lb one room (choice i uses room + i); each
    choice is its own prefill + decode pair of requests, on rooms that prefill and decode agree on."""
    want = chat(stack.gateway, False, max_tokens=16, temperature=1.0, seed=7, n=2)
    assert len(want) == 2 and all(len(text) == 16 for text in want)
    assert chat(stack.routers[router], False, max_tokens=16, temperature=1.0, seed=7, n=2) == want
    prefill_rooms = [r["room"] for r in stack.prefill.get("/debug/rooms")][-2:]  # type: ignore[index, union-attr]
    decode_rooms = [r["room"] for r in stack.decode.get("/debug/rooms")][-2:]  # type: ignore[index, union-attr]
    assert len(set(decode_rooms)) == 2 and sorted(prefill_rooms) == sorted(decode_rooms)


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
def test_a_prompt_array_with_several_choices(stack: Stack, router: str) -> None:
    """Completions with a prompt array and n=2: the Rust router sends bootstrap lists sized to n, not to
    prompts x n (SGLang's own server repeats a short list): every choice still gets a room of its own,
    on which prefill and decode agree, and each prompt's choices are what our gateway gives."""
    body = {"model": "sim", "prompt": ["Prefill first,", "then the decode"], "n": 2, "max_tokens": 10,
            "temperature": 1.0, "seed": 5}
    want = httpx.post(f"{stack.gateway}/v1/completions", json=body, timeout=60)
    assert want.status_code == 200, want.text
    got = httpx.post(f"{stack.routers[router]}/v1/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    texts = [[c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])] for r in (got, want)]
    assert len(texts[0]) == 4 and texts[0] == texts[1]
    prefill_rooms = [r["room"] for r in stack.prefill.get("/debug/rooms")][-4:]  # type: ignore[index, union-attr]
    decode_rooms = [r["room"] for r in stack.decode.get("/debug/rooms")][-4:]  # type: ignore[index, union-attr]
    assert len(set(decode_rooms)) == 4 and sorted(prefill_rooms) == sorted(decode_rooms)


@pytest.mark.parametrize("router", ["rust", "mini_lb"])
def test_a_request_without_a_model_is_served(stack: Stack, router: str) -> None:
    """``model`` is optional in SGLang's protocol (the Rust router sends "unknown" for a request without
    one); our workers serve any name, as SGLang's server does; our gateway keeps to its own."""
    body = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    want = httpx.post(f"{stack.gateway}/v1/chat/completions", json=body, timeout=60)
    assert want.status_code == 200, want.text
    got = httpx.post(f"{stack.routers[router]}/v1/chat/completions", json=body, timeout=60)
    assert got.status_code == 200, got.text
    assert got.json()["choices"][0]["message"]["content"] == want.json()["choices"][0]["message"]["content"]
    other = httpx.post(f"{stack.gateway}/v1/chat/completions", json={**body, "model": "other"}, timeout=60)
    assert other.status_code == 404, other.text


@pytest.mark.parametrize("via", ["decode", "rust", "mini_lb"])
def test_a_refused_streamed_generate_is_an_error_event_every_router_can_read(stack: Stack, via: str) -> None:
    """A streamed ``/generate`` the workers refuse (a sampling field the sim engine lacks, a minimum over its budget) is
    answered as SGLang's server answers it: 200, ``data: {"error": {"message": ...}}``, ``data: [DONE]``. A
    400 was turned by the Rust router into a cut-off ``data: {'error': ...`` line no client could parse; a
    whole answer stays a 400."""
    bad = [{"text": PROMPT, "sampling_params": {"max_new_tokens": 4, "presence_penalty": 1.0}},
           {"text": PROMPT, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 4}}]
    if via == "decode":
        url = f"http://127.0.0.1:{stack.decode.http_port}/generate"
        extra: dict[str, object] = {"bootstrap_host": "127.0.0.1", "bootstrap_port": None, "bootstrap_room": 7}
    else:
        url, extra = f"{stack.routers[via]}/generate", {}
    for body in bad:
        reply = httpx.post(url, json={**body, **extra, "stream": True}, timeout=30)
        assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream"), \
            (reply.status_code, reply.headers, reply.text)
        lines = [line for line in reply.text.splitlines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and len(lines) == 2, reply.text
        assert json.loads(lines[0][6:])["error"]["message"], reply.text
        whole = httpx.post(url, json={**body, **extra}, timeout=30)
        assert whole.status_code == 400 and whole.json()["error"]["message"], whole.text


def test_pools_full_after_the_routers_requests(stack: Stack) -> None:
    deadline = time.monotonic() + 20
    while not stack.pools_full():
        assert time.monotonic() < deadline, "a KV page leaked"
        time.sleep(0.1)


def test_worker_metadata_routes(stack: Stack) -> None:
    info = stack.decode.get("/get_server_info")
    assert isinstance(info, dict) and info["disaggregation_mode"] == "decode"
    prefill_info = stack.prefill.get("/server_info")
    assert isinstance(prefill_info, dict) and prefill_info["disaggregation_mode"] == "prefill"
    assert prefill_info["disaggregation_bootstrap_port"] is not None
    assert stack.prefill.get("/get_model_info")["is_generation"] is True  # type: ignore[index]
    assert stack.decode.get("/v1/models")["data"][0]["id"] == "sim"  # type: ignore[index]
    assert stack.decode.get("/health_generate") == {"status": "ok"}
    flushed = httpx.post(f"http://127.0.0.1:{stack.prefill.http_port}/flush_cache", timeout=10)
    assert flushed.status_code == 200 and flushed.json()["status"] == "ok"


@pytest.mark.slow
def test_real_model_through_the_rust_router(router_site: Path, procs: Procs) -> None:
    """SmolLM2 (torch engine) prefill + decode behind SGLang's Rust router: a correct answer, equal to our
    gateway's for the same greedy request, and the prompt's logprobs merged from the prefill."""
    from workers.engines.llama.gguf_convert import default_model_dir

    default_model_dir()  # convert once (cached) before two processes race for it
    bootstrap_port = free_port()
    common = ("--engine", "torch", "--num-pages", "256", "--chunk-size", "32")
    prefill = start_worker(procs, "prefill", *common, "--bootstrap-embedded", str(bootstrap_port))
    decode = start_worker(procs, "decode", *common)
    ours = f"http://127.0.0.1:{start_gateway(procs, '--prefill', prefill.url, '--decode', decode.url)}"
    rust = start_router(procs, router_site, prefill, bootstrap_port, decode)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for base in (ours, rust):
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        out = c.chat.completions.create(model="default", messages=question, max_tokens=24, temperature=0)  # type: ignore[arg-type]
        answers.append(out.choices[0].message.content or "")
    assert "Paris" in answers[0] and answers[1] == answers[0]
    body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    mine = httpx.post(f"{ours}/generate", json=body, timeout=120).json()
    theirs = httpx.post(f"{rust}/generate", json=body, timeout=120).json()
    assert theirs["text"] == mine["text"]
    prompt_lps = theirs["meta_info"]["input_token_logprobs"]
    assert len(prompt_lps) == len(mine["meta_info"]["input_token_logprobs"]) > 1, "merged from the prefill"
    for (a, t1, _), (b, t2, _) in zip(prompt_lps[1:], mine["meta_info"]["input_token_logprobs"][1:], strict=True):
        assert t1 == t2 and abs(a - b) < 1e-3
