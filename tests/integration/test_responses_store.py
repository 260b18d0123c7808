"""Stored responses on ``/v1/responses`` (``gateway/response_store.py``), with the real openai client against a real
gateway over sim workers: turns chained with ``previous_response_id`` (the worker sees the earlier turns: its
output is the sim's answer to the whole conversation's prompt), ``GET`` and ``DELETE /v1/responses/{id}``, 404s for
what is not stored, ``store: false``, the LRU bound, and keys that cannot see each other's responses."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from sim_reference import expected_tokens, text_of

BOS = 256  # the byte tokenizer's (gateway/tokenizer.py)


def _client(cluster: Any, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key=key, max_retries=0, timeout=60)


def _sim_answer(turns: list[tuple[str, str]], max_tokens: int) -> str:
    """What the sim answers to the chat prompt of ``turns`` ((role, text) pairs) through the byte tokenizer's
    template: the prompt the worker saw, checked through its output."""
    prompt = "".join(f"<|{role}|>\n{text}\n" for role, text in turns) + "<|assistant|>\n"
    return text_of(expected_tokens([BOS, *prompt.encode()], max_tokens))


def _not_found(call: Any, param: str | None = None) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        call()
    error = caught.value.body
    assert isinstance(error, dict) and error["type"] == "invalid_request_error" and error["param"] == param, error


def test_chained_turns_get_delete_and_keys(sim_cluster: Any) -> None:
    cluster = sim_cluster(gateway_args=("--api-key", "key-a", "--api-key", "key-b", "--responses-store-max", "3"))
    alice, bob = _client(cluster, "key-a"), _client(cluster, "key-b")

    # turn 1: stored by default (store absent), its instructions a system message
    r1 = alice.responses.create(model="default", instructions="Be brief.", input="Hello there", max_output_tokens=6)
    assert r1.to_dict()["store"] is True and r1.previous_response_id is None
    assert r1.output_text == _sim_answer([("system", "Be brief."), ("user", "Hello there")], 6)

    # turn 2 continues turn 1: its input and output in front of the new input; turn 1's instructions stay behind
    r2 = alice.responses.create(model="default", previous_response_id=r1.id, input="And again?", max_output_tokens=7)
    assert r2.previous_response_id == r1.id and r2.instructions is None
    two = [("user", "Hello there"), ("assistant", r1.output_text), ("user", "And again?")]
    assert r2.output_text == _sim_answer(two, 7)
    # the same conversation sent whole is the same prompt
    whole = alice.responses.create(model="default", max_output_tokens=7, store=False, input=[
        {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": r1.output_text},
        {"role": "user", "content": "And again?"}])
    assert r2.usage is not None and whole.usage is not None and whole.usage.input_tokens == r2.usage.input_tokens

    # turn 3, streamed, continues the chain (turns 1 and 2) with new instructions; stored once complete
    events = list(alice.responses.create(model="default", previous_response_id=r2.id, instructions="New rules.",
                                         input=[{"role": "user", "content": [{"type": "input_text", "text": "Third"}]}],
                                         max_output_tokens=5, stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete" and final.to_dict()["store"] is True
    three = [("system", "New rules."), *two, ("assistant", r2.output_text), ("user", "Third")]
    assert final.output_text == _sim_answer(three, 5)

    # GET answers the stored objects
    got = alice.responses.retrieve(final.id)
    assert got.id == final.id and got.output_text == final.output_text and got.previous_response_id == r2.id
    assert got.status == "incomplete" and got.usage is not None and got.usage.output_tokens == 5
    assert alice.responses.retrieve(r1.id).output_text == r1.output_text
    # streaming a retrieval (OpenAI's, of a background response's events) is a 400, not JSON the SDK's stream drops
    with pytest.raises(openai.BadRequestError) as streamed:
        list(alice.responses.retrieve(r1.id, stream=True))
    assert isinstance(streamed.value.body, dict) and streamed.value.body["param"] == "stream", streamed.value.body
    assert alice.responses.retrieve(r1.id, extra_query={"stream": "false"}).id == r1.id

    # another key sees none of it: not to read, continue or delete; no key at all is a 401
    _not_found(lambda: bob.responses.retrieve(r1.id))
    _not_found(lambda: bob.responses.create(model="default", previous_response_id=r1.id, input="x",
                                            max_output_tokens=1), "previous_response_id")
    assert httpx.delete(f"{cluster.base_url}/v1/responses/{r1.id}", headers={"authorization": "Bearer key-b"},
                        timeout=30).status_code == 404
    assert httpx.get(f"{cluster.base_url}/v1/responses/{r1.id}", timeout=30).status_code == 401
    assert alice.responses.retrieve(r1.id).id == r1.id

    # unknown ids
    _not_found(lambda: alice.responses.retrieve("resp_nope"))
    _not_found(lambda: alice.responses.create(model="default", previous_response_id="resp_nope", input="x",
                                              max_output_tokens=1), "previous_response_id")
    r = httpx.post(f"{cluster.base_url}/v1/responses", headers={"authorization": "Bearer key-a"}, timeout=30,
                   json={"input": "x", "previous_response_id": "resp_nope", "stream": True})
    assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"

    # store: false is answered false and kept nowhere
    unstored = alice.responses.create(model="default", input="Off the record", max_output_tokens=2, store=False)
    assert unstored.to_dict()["store"] is False
    _not_found(lambda: alice.responses.retrieve(unstored.id))
    _not_found(lambda: alice.responses.create(model="default", previous_response_id=unstored.id, input="x",
                                              max_output_tokens=1), "previous_response_id")

    # DELETE: OpenAI's shape, then gone
    url, auth = f"{cluster.base_url}/v1/responses/{final.id}", {"authorization": "Bearer key-a"}
    deleted = httpx.delete(url, headers=auth, timeout=30)
    assert deleted.status_code == 200 and deleted.json() == {"id": final.id, "object": "response.deleted",
                                                             "deleted": True}
    assert httpx.delete(url, headers=auth, timeout=30).status_code == 404
    _not_found(lambda: alice.responses.retrieve(final.id))

    # the bound (3): the least recently used goes first; reading one makes it recent
    a, b, c = (alice.responses.create(model="default", input=f"n{i}", max_output_tokens=1) for i in range(3))
    for old in (r1, r2):  # (pushed out by a, b, c)
        _not_found(lambda old=old: alice.responses.retrieve(old.id))
    alice.responses.retrieve(a.id)  # a: used last now, b the least recently used
    d = alice.responses.create(model="default", previous_response_id=c.id, input="more", max_output_tokens=1)
    _not_found(lambda: alice.responses.retrieve(b.id))
    assert {alice.responses.retrieve(x.id).id for x in (a, c, d)} == {a.id, c.id, d.id}
    cluster.wait_pools_full()


def test_no_store_answers_as_a_stateless_gateway(sim_cluster: Any) -> None:
    """``--responses-store-max 0``: ``store`` answered false, ``previous_response_id`` a 400 naming it, GET a 404."""
    cluster = sim_cluster(gateway_args=("--responses-store-max", "0"))
    client = _client(cluster)
    response = client.responses.create(model="default", input="Hello", max_output_tokens=2)
    assert response.to_dict()["store"] is False
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="default", input="x", previous_response_id=response.id, max_output_tokens=1)
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == "previous_response_id"
    _not_found(lambda: client.responses.retrieve(response.id))
    cluster.wait_pools_full()
