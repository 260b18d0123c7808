"""Review (openai SDK features) against a real sim cluster, with the real ``openai`` client.

- The SDK retries every 5xx (``_should_retry``: 408, 409, 429, >= 500) twice by default unless the answer
  says ``x-should-retry: false``. The gateway's 504 for ``--request-timeout-s`` ("the request ran past its
  timeout") is deterministic for the request (its budget does not fit the deadline), yet says nothing: the
  SDK sends it again twice, and each try holds a prefill/decode pair for the whole deadline (3x the work).
- ``web_search_options`` (a chat-completions argument of the SDK that changes what the answer is) is not a
  field the gateway knows: it is ignored and the request answered without a search, where the docs' rule is a
  400 naming what the gateway does not implement (as ``audio`` and ``modalities`` are).
"""

from __future__ import annotations

import httpx
import openai


def _count(base_url: str, line_start: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


def test_a_request_deadline_504_is_not_retried_by_the_sdk(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(worker_args=("--engine-option", "decode_step_s=0.02"),
                          gateway_args=("--request-timeout-s", "1"))
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", timeout=120)  # default max_retries=2
    metric = 'pd_gateway_requests_total{route="chat",status="504"}'
    before = _count(cluster.base_url, metric)
    raw = client.with_options(max_retries=0).chat.completions.with_raw_response
    try:
        raw.create(model="default", max_tokens=900, extra_body={"ignore_eos": True},
                   messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected a 504")
    except openai.InternalServerError as exc:
        assert exc.status_code == 504, exc
        assert exc.response.headers.get("x-should-retry") == "false", dict(exc.response.headers)
    try:
        client.chat.completions.create(model="default", max_tokens=900, extra_body={"ignore_eos": True},
                                       messages=[{"role": "user", "content": "hi"}])
        raise AssertionError("expected a 504")
    except openai.InternalServerError as exc:
        assert exc.status_code == 504, exc
    assert _count(cluster.base_url, metric) - before == 2, "the SDK ran the timed-out request again"
    cluster.wait_pools_full()


def test_web_search_options_is_refused_not_silently_ignored(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "What is in today's news?"}]
    try:
        client.chat.completions.create(model="default", max_tokens=4, messages=messages,  # type: ignore[arg-type]
                                       web_search_options={"search_context_size": "low"})
        raise AssertionError("web_search_options was answered without a search, and without a word")
    except openai.BadRequestError as exc:
        assert exc.param == "web_search_options", exc
