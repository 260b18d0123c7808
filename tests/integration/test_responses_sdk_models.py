"""``/v1/responses`` answers validated strictly against the installed openai SDK's own models (the SDK itself
builds them without validation, so a field it requires that we omit reads as ``None`` where its type says
``int``): the whole response and every stream event, and an answer cut by its budget says so on its message
item too (``status: incomplete``), as on the response."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pydantic
from openai.types.responses import Response, ResponseStreamEvent


def _events(body: str) -> list[dict[str, Any]]:
    return [json.loads(block.split("\n")[-1][len("data: "):]) for block in body.split("\n\n") if block]


def test_the_response_and_its_events_validate_against_the_sdk_models(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    url = f"{cluster.base_url}/v1/responses"
    r = httpx.post(url, json={"input": "hi", "max_output_tokens": 5, "metadata": {"k": "v"}}, timeout=60)
    assert r.status_code == 200, r.text
    whole = Response.model_validate(r.json())  # (raised: usage.input_tokens_details.cache_write_tokens missing)
    assert whole.usage is not None and whole.usage.input_tokens_details.cache_write_tokens == 0
    # the sim never ends on EOS: the budget cut the answer, and its one message says so as the response does
    assert whole.status == "incomplete" and [item.status for item in whole.output] == ["incomplete"]
    assert whole.output_text

    r = httpx.post(url, json={"input": "hi", "max_output_tokens": 5, "stream": True}, timeout=60)
    assert r.status_code == 200, r.text
    adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(ResponseStreamEvent)
    events = [adapter.validate_python(event) for event in _events(r.text)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1]
    assert final.type == "response.incomplete"
    assert final.response.usage.input_tokens_details.cache_write_tokens == 0
    assert [item.status for item in final.response.output] == ["incomplete"]
    done = next(e for e in events if e.type == "response.output_item.done")
    assert done.item.status == "incomplete" and done.item.content[0].text == final.response.output_text
    cluster.wait_pools_full()
