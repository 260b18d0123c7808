"""SmolLM2-135M through the PD path: real workers (torch engine), real gateway, the openai client."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from pdtest import Procs, SmolDeployment, start_gateway, start_smollm2, wait_pools_full

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors.",
    "Write one sentence about the sea.",
]


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolDeployment]:
    procs = Procs(tmp_path_factory.mktemp("smollm2"))
    try:
        yield start_smollm2(procs, chunk_size=32)
    finally:
        procs.stop_all()


def chat(url: str, question: str, **kw: object) -> openai.types.chat.ChatCompletion:
    c = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    return c.chat.completions.create(model="default", messages=[{"role": "user", "content": question}], **kw)  # type: ignore[call-overload, no-any-return]


def test_capital_of_france_via_prefill_to_decode(deployment: SmolDeployment) -> None:
    out = chat(deployment.pd_v1, QUESTIONS[0], max_tokens=24, temperature=0)
    assert "Paris" in (out.choices[0].message.content or "")
    c = openai.OpenAI(base_url=deployment.pd_v1, api_key="none", max_retries=0, timeout=120)
    stream = c.chat.completions.create(model="default", max_tokens=24, temperature=0, stream=True,
                                       messages=[{"role": "user", "content": QUESTIONS[0]}])
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == out.choices[0].message.content


@pytest.mark.parametrize("question", QUESTIONS)
def test_pd_greedy_equals_combined_worker(deployment: SmolDeployment, question: str) -> None:
    pd = chat(deployment.pd_v1, question, max_tokens=20, temperature=0)
    both = chat(deployment.both_v1, question, max_tokens=20, temperature=0)
    assert pd.choices[0].message.content == both.choices[0].message.content
    assert pd.usage and both.usage and pd.usage.completion_tokens == both.usage.completion_tokens


def stop_string_case(deployment: SmolDeployment) -> tuple[str, str]:
    """A stop string from the middle of a greedy answer, and the answer's text before it."""
    full = chat(deployment.pd_v1, QUESTIONS[2], max_tokens=24, temperature=0).choices[0].message.content or ""
    words = full.split()
    assert len(words) >= 4, full
    stop = " " + words[2]  # a piece of text the answer reaches after a few tokens
    return stop, full[: full.index(stop)]


def decode_stops(deployment: SmolDeployment) -> float:
    """Requests the PD decode ended at a stop string itself."""
    decode = next(w for w in deployment.workers if w.role == "decode")
    text = httpx.get(f"http://127.0.0.1:{decode.http_port}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pd_worker_requests_finished") and 'reason="stop"' in line)


def test_a_stop_string_ends_the_answer_on_the_decode(deployment: SmolDeployment) -> None:
    """PD and the combined worker both answer the text before the stop string, and the decode
    (SmolLM2's tokenizer on the worker) ended the request there itself."""
    stop, cut = stop_string_case(deployment)
    before = decode_stops(deployment)
    for url in (deployment.pd_v1, deployment.both_v1):
        out = chat(url, QUESTIONS[2], max_tokens=24, temperature=0, stop=[stop])
        assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop", url
    assert decode_stops(deployment) == before + 1  # the PD request: ended by the decode, not aborted


def test_stop_strings_stay_with_a_gateway_whose_tokenizer_file_differs(deployment: SmolDeployment,
                                                                       tmp_path: Path) -> None:
    """A gateway with its own copy of the model's tokenizer (``--tokenizer``, as on another host) leaves
    stop strings to the decode when its ``tokenizer.json`` is the worker's byte for byte; when the file
    differs (here only re-indented, but it could decode ids to other text) it keeps the strings to itself
    and aborts at them, with a warning at start-up. The answers are the same either way."""
    stop, cut = stop_string_case(deployment)
    prefill, decode = (next(w for w in deployment.workers if w.role == role) for role in ("prefill", "decode"))
    source = Path(httpx.get(f"http://127.0.0.1:{decode.http_port}/info", timeout=10).json()["tokenizer"])
    same, edited = tmp_path / "same", tmp_path / "edited"
    shutil.copytree(source, same)
    shutil.copytree(source, edited)
    (edited / "tokenizer.json").write_text(json.dumps(json.loads((source / "tokenizer.json").read_text()), indent=1))
    procs = Procs(tmp_path)
    try:
        for copy, decode_stopped in ((same, 1), (edited, 0)):
            port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url, "--tokenizer", str(copy))
            before = decode_stops(deployment)
            out = chat(f"http://127.0.0.1:{port}/v1", QUESTIONS[2], max_tokens=24, temperature=0, stop=[stop])
            assert out.choices[0].message.content == cut and out.choices[0].finish_reason == "stop", copy
            assert decode_stops(deployment) == before + decode_stopped, copy
            warned = "watches stop strings with another tokenizer" in procs.log(f"gateway-{port}")
            assert warned == (copy == edited), procs.log(f"gateway-{port}")
    finally:
        procs.stop_all()
    wait_pools_full(deployment.workers, 30)


def test_seeded_sampling_reproduces_across_the_split(deployment: SmolDeployment) -> None:
    kw = {"max_tokens": 16, "temperature": 0.9, "top_p": 0.95, "seed": 1234}
    pd = chat(deployment.pd_v1, QUESTIONS[2], **kw)
    both = chat(deployment.both_v1, QUESTIONS[2], **kw)
    assert pd.choices[0].message.content == both.choices[0].message.content


def test_prefix_cache_hit_reports_cached_tokens(deployment: SmolDeployment) -> None:
    question = "Explain in one line why the sky looks blue to people standing outside on a sunny day."
    first = chat(deployment.pd_v1, question, max_tokens=8, temperature=0)
    second = chat(deployment.pd_v1, question, max_tokens=8, temperature=0)
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage and second.usage.prompt_tokens_details
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_bad_input_is_rejected_with_400(deployment: SmolDeployment) -> None:
    base = deployment.pd_v1
    too_long = httpx.post(f"{base}/completions", json={"prompt": [1] * 9000, "max_tokens": 4}, timeout=60)
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    beyond = httpx.post(f"{base}/completions", json={"prompt": "Hello", "max_tokens": 9000}, timeout=60)
    assert beyond.status_code == 400 and beyond.json()["error"]["param"] == "max_tokens"
    unknown = httpx.post(f"{base}/chat/completions", timeout=60,
                         json={"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    bad_ids = httpx.post(f"{base}/completions", json={"prompt": [10**9], "max_tokens": 2}, timeout=60)
    assert bad_ids.status_code == 400


def test_pools_back_to_full(deployment: SmolDeployment) -> None:
    wait_pools_full(deployment.workers, 30)


def test_chat_logprobs_through_the_split(deployment: SmolDeployment) -> None:
    kw = {"max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 3}
    pd = chat(deployment.pd_v1, QUESTIONS[1], **kw)
    both = chat(deployment.both_v1, QUESTIONS[1], **kw)
    pd_entries = pd.choices[0].logprobs.content  # type: ignore[union-attr]
    both_entries = both.choices[0].logprobs.content  # type: ignore[union-attr]
    assert pd_entries and both_entries and len(pd_entries) == len(both_entries) == 6
    for a, b in zip(pd_entries, both_entries, strict=True):
        assert a.token == b.token and abs(a.logprob - b.logprob) < 1e-4
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].token == a.token, "greedy picks the top token"
        assert a.logprob <= 0 and a.top_logprobs[0].logprob >= a.top_logprobs[1].logprob


def test_generate_returns_input_and_output_logprobs(deployment: SmolDeployment) -> None:
    body = {"text": "The quick brown fox jumps over the lazy dog.",
            "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "return_logprob": True, "logprob_start_len": 0}
    results = []
    for url in (deployment.pd_v1, deployment.both_v1):
        r = httpx.post(url.removesuffix("/v1") + "/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        results.append(r.json())
    for res in results:
        meta = res["meta_info"]
        inputs = meta["input_token_logprobs"]
        assert len(inputs) == meta["prompt_tokens"] and inputs[0][0] is None
        assert all(lp is not None and lp <= 0 for lp, _, _ in inputs[1:])
        assert len(meta["output_token_logprobs"]) == 4
    pd_in = [lp for lp, _, _ in results[0]["meta_info"]["input_token_logprobs"][1:]]
    both_in = [lp for lp, _, _ in results[1]["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(pd_in, both_in, strict=True)) < 1e-4
    assert results[0]["text"] == results[1]["text"]


def test_prompt_logprobs_of_a_cached_prompt_are_the_whole_prompts(deployment: SmolDeployment) -> None:
    """Asked twice, a prompt of several KV pages is cached on its prefill the second time: its input
    logprobs must still cover every position, the same values as the first time (before, a cache hit
    gave only the uncached suffix's, which the response put at the prompt's first positions)."""
    text = ("A prefix cache keeps the key and value pages of prompts it has seen, so that a request "
            "sharing their beginning skips computing it again; logprobs of the prompt need every position.")
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
            "logprob_start_len": 0}
    for url in (deployment.pd_v1, deployment.both_v1):
        rounds = []
        for _ in range(2):
            r = httpx.post(url.removesuffix("/v1") + "/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            rounds.append(r.json()["meta_info"])
        first, second = rounds
        assert first["prompt_tokens"] > 32  # at least two full pages of 16 to share
        assert len(second["input_token_logprobs"]) == second["prompt_tokens"] == first["prompt_tokens"]
        a = [lp for lp, _, _ in first["input_token_logprobs"][1:]]
        b = [lp for lp, _, _ in second["input_token_logprobs"][1:]]
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, url


def test_logprob_start_len_scores_the_prompt_from_there(deployment: SmolDeployment) -> None:
    """SGLang's ``logprob_start_len``: by default (-1) the prompt's last position alone, k the positions from k
    on, each the value the whole prompt's request gives there; a prompt asked again shares its cached pages
    before the start (before, a request for prompt logprobs shared none); a batch takes one start per item."""
    text = ("Logprobs of a prompt's tail are what a reinforcement learning loop asks for most: the model's "
            "belief in the tokens after a shared instruction, which the prefix cache already holds. Asked again "
            "with another start, only the positions from there on are scored, and the rest comes from the cache.")
    for url in (deployment.pd_v1, deployment.both_v1):
        generate = url.removesuffix("/v1") + "/generate"

        def ask(**fields: Any) -> dict[str, Any]:
            body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "return_logprob": True,
                    **fields}
            r = httpx.post(generate, json=body, timeout=120)  # noqa: B023
            assert r.status_code == 200, r.text
            return r.json()["meta_info"]

        whole = ask(logprob_start_len=0)
        n = whole["prompt_tokens"]
        assert n > 40 and len(whole["input_token_logprobs"]) == n
        default = ask()["input_token_logprobs"]
        assert len(default) == 1 and default[0][1] == whole["input_token_logprobs"][-1][1]
        assert abs(default[0][0] - whole["input_token_logprobs"][-1][0]) < 1e-4, url
        tail = ask(logprob_start_len=36)  # past two full pages of 16: those may come from the cache
        assert tail["cached_tokens"] >= 32, (url, tail["cached_tokens"])
        assert [t for _, t, _ in tail["input_token_logprobs"]] == [t for _, t, _ in whole["input_token_logprobs"][36:]]
        assert max(abs(a - b) for (a, _, _), (b, _, _) in
                   zip(tail["input_token_logprobs"], whole["input_token_logprobs"][36:], strict=True)) < 1e-4, url
        r = httpx.post(generate, timeout=120, json={"text": [text, "Hello there"], "return_logprob": True,
                                                   "logprob_start_len": [n - 2, 0],
                                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        assert r.status_code == 200, r.text
        items = r.json()
        assert len(items[0]["meta_info"]["input_token_logprobs"]) == 2
        assert len(items[1]["meta_info"]["input_token_logprobs"]) == items[1]["meta_info"]["prompt_tokens"]
        r = httpx.post(generate, timeout=120, json={"text": text, "return_logprob": True, "logprob_start_len": n})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprob_start_len", r.text
        # SGLang's scoring: max_new_tokens 0, the prompt's logprobs alone
        scored = httpx.post(generate, timeout=120, json={"text": text, "return_logprob": True, "logprob_start_len": 0,
                                                        "sampling_params": {"max_new_tokens": 0}})
        assert scored.status_code == 200, scored.text
        out = scored.json()
        assert out["text"] == "" and out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
        assert max(abs(a - b) for (a, _, _), (b, _, _) in zip(out["meta_info"]["input_token_logprobs"][1:],
                                                              whole["input_token_logprobs"][1:], strict=True)) < 1e-4


def test_completions_echo_with_logprobs(deployment: SmolDeployment) -> None:
    prompt = "Roses are red, violets are"
    r = httpx.post(f"{deployment.pd_v1}/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
    lp = choice["logprobs"]
    n_prompt = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][:n_prompt]) == prompt
    # Each token's text_offset is where its text starts in the choice's text (echoed prompt included).
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert choice["text"][lp["text_offset"][n_prompt]:].startswith(lp["tokens"][n_prompt])
    # Every prompt position after the first has its most likely tokens, its own among them (what
    # lm-evaluation-harness's loglikelihood reads: max(top.values()) tells a greedy continuation).
    assert lp["top_logprobs"][0] is None
    for token, value, top in zip(lp["tokens"][1:n_prompt], lp["token_logprobs"][1:n_prompt],
                                 lp["top_logprobs"][1:n_prompt], strict=True):
        assert 2 <= len(top) <= 3 and top[token] == value and max(top.values()) >= value, (token, value, top)
    both = httpx.post(f"{deployment.both_v1}/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 2}).json()
    for ours, theirs in zip(lp["top_logprobs"][1:n_prompt], both["choices"][0]["logprobs"]["top_logprobs"][1:n_prompt],
                            strict=True):
        assert ours.keys() == theirs.keys() and all(abs(ours[k] - theirs[k]) < 1e-4 for k in ours), "P->D = one worker"
    # ``logprobs: 0``: each known position's top_logprobs is the token alone, prompt and answer alike.
    zero = httpx.post(f"{deployment.pd_v1}/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 0}).json()
    zero = zero["choices"][0]["logprobs"]
    assert zero["top_logprobs"][0] is None
    assert zero["top_logprobs"][1:] == [{t: v} for t, v in zip(zero["tokens"][1:], zero["token_logprobs"][1:],
                                                                strict=True)]


def test_streamed_echo_with_logprobs_is_the_whole_responses(deployment: SmolDeployment) -> None:
    """Streamed, the prompt's tokens and logprobs come in the first chunk, and the chunks' logprobs
    joined (text offsets counted on across chunks) are the whole response's."""
    for url in (deployment.pd_v1, deployment.both_v1):  # (a combined worker's come with its first output too)
        check_streamed_echo(url)


def check_streamed_echo(url: str) -> None:
    body = {"prompt": "Roses are red, violets are", "max_tokens": 4, "temperature": 0, "echo": True, "logprobs": 2}
    whole = httpx.post(f"{url}/completions", json=body, timeout=120).json()["choices"][0]
    joined: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": [], "top_logprobs": []}
    text = ""
    with httpx.stream("POST", f"{url}/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            text += choice["text"]
            for key in joined:
                joined[key] += choice["logprobs"][key]
    assert text == whole["text"]
    assert joined["tokens"] == whole["logprobs"]["tokens"] and joined["text_offset"] == whole["logprobs"]["text_offset"]
    assert joined["token_logprobs"][0] is None and whole["logprobs"]["token_logprobs"][0] is None
    for ours, theirs in zip(joined["token_logprobs"][1:], whole["logprobs"]["token_logprobs"][1:], strict=True):
        assert abs(ours - theirs) < 1e-4
    for ours, theirs in zip(joined["top_logprobs"][1:], whole["logprobs"]["top_logprobs"][1:], strict=True):
        assert ours.keys() == theirs.keys()


def test_responses_api_answers_as_chat_does(deployment: SmolDeployment) -> None:
    """``/v1/responses`` runs the chat path: greedy, its text is chat's for the same messages (``instructions`` a
    system message in front); an answer that ends on EOS is ``completed``, streamed or not, and the SDK's stream
    helper assembles the same response from the events."""
    c = openai.OpenAI(base_url=deployment.pd_v1, api_key="none", max_retries=0, timeout=120)
    expected = c.chat.completions.create(model="default", max_tokens=64, temperature=0, messages=[
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": QUESTIONS[0]}])
    assert expected.choices[0].finish_reason == "stop", "the question's answer should end within 64 tokens"
    kw: dict[str, Any] = {"model": "default", "max_output_tokens": 64, "temperature": 0,
                          "instructions": "You answer in one short sentence.", "input": QUESTIONS[0]}
    whole = c.responses.create(**kw)
    assert whole.status == "completed" and whole.incomplete_details is None and whole.completed_at
    assert whole.output_text == expected.choices[0].message.content
    assert whole.usage is not None and expected.usage is not None
    assert (whole.usage.input_tokens, whole.usage.output_tokens) == (expected.usage.prompt_tokens,
                                                                     expected.usage.completion_tokens)
    with c.responses.stream(**kw) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert deltas == final.output_text == whole.output_text and final.status == "completed"
    # the same conversation as input items (an earlier turn's answer included) on the combined worker's gateway
    both = openai.OpenAI(base_url=deployment.both_v1, api_key="none", max_retries=0, timeout=120)
    turns: list[Any] = [{"role": "user", "content": QUESTIONS[1]},
                        {"role": "assistant", "content": [{"type": "output_text", "text": "Red, green, blue."}]},
                        {"role": "user", "content": [{"type": "input_text", "text": QUESTIONS[0]}]}]
    chat_turns = [{"role": "user", "content": QUESTIONS[1]}, {"role": "assistant", "content": "Red, green, blue."},
                  {"role": "user", "content": QUESTIONS[0]}]
    pd_answer = c.responses.create(model="default", input=turns, max_output_tokens=24, temperature=0).output_text
    assert pd_answer == both.responses.create(model="default", input=turns, max_output_tokens=24,
                                              temperature=0).output_text
    as_chat = c.chat.completions.create(model="default", messages=chat_turns, max_tokens=24,  # type: ignore[arg-type]
                                        temperature=0)
    assert pd_answer == as_chat.choices[0].message.content
    wait_pools_full(deployment.workers)
