"""``GET /v1/responses/{id}/input_items`` lists every input item the route accepted in a shape the openai SDK's types
accept (``ResponseItemList.model_validate``): the route takes an assistant turn's text as ``input_text`` parts, a
user's as ``output_text`` or ``refusal`` parts, a function call's output as ``output_text`` parts, but OpenAI's
items have an input message's parts ``input_text`` (roles user, system, developer) and an assistant message's
``output_text`` or ``refusal`` (an output message), a function call output's ``input_text``. Listed as given, such
items matched none of the SDK's item types. Real processes: a gateway over sim workers, the real openai client."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from openai.types.responses import ResponseItemList
from pdtest import SimCluster
from test_responses_store import _client

MIXED = [
    {"role": "user", "content": [{"type": "output_text", "text": "A user's text as output_text"}]},
    {"role": "user", "content": [{"type": "refusal", "refusal": "A user's text as a refusal"}]},
    {"role": "assistant", "content": [{"type": "input_text", "text": "An assistant's text as input_text"},
                                      {"type": "refusal", "refusal": "and a refusal"}]},
    {"role": "developer", "content": [{"type": "output_text", "text": "A developer's as output_text"}]},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "output_text", "text": "sunny"}]},
    {"role": "user", "content": "Thanks"},
]


def test_every_accepted_input_item_is_listed_as_the_sdk_types_it(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    client = _client(cluster)
    first = client.responses.create(model="default", input=MIXED, max_output_tokens=2)  # type: ignore[arg-type]
    then = client.responses.create(model="default", input="More", previous_response_id=first.id,
                                   max_output_tokens=2)
    for rid in (first.id, then.id):
        raw = httpx.get(f"{cluster.base_url}/v1/responses/{rid}/input_items", params={"order": "asc"},
                        timeout=30).json()
        listed = ResponseItemList.model_validate(raw)
        texts = [[getattr(part, "text", None) or getattr(part, "refusal", None) for part in item.content]
                 if item.type == "message" else item.output if item.type == "function_call_output" else None
                 for item in listed.data[:len(MIXED)]]
        assert texts[:4] == [["A user's text as output_text"], ["A user's text as a refusal"],
                             ["An assistant's text as input_text", "and a refusal"],
                             ["A developer's as output_text"]]  # (the text as given, in the parts of its role)
        output = listed.data[5]
        assert output.type == "function_call_output" and [p.text for p in output.output] == ["sunny"]  # type: ignore[union-attr]
        assert [item.type for item in listed.data[:len(MIXED)]] == [item.get("type", "message") for item in MIXED]
    # and the prompt the continuation saw is the one the whole conversation makes (the items' text unchanged)
    whole = client.responses.create(model="default", max_output_tokens=2, store=False,  # type: ignore[arg-type]
                                    input=[*MIXED, *[o.to_dict() for o in first.output],
                                           {"role": "user", "content": "More"}])
    assert whole.output_text == then.output_text
    cluster.wait_pools_full()
