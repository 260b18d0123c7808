"""A body that leaves out a required field (a message without its ``role``) is a 400 whose ``param`` names that field,
``messages[0].role``, as OpenAI's does; it named the message, ``messages[0]``, so a client pointing at the field the
error names pointed at the wrong one."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from gateway.api import decode_body
from gateway.api_models import ChatCompletionRequest
from gateway.errors import BadRequest


def test_a_missing_role_names_the_role(sim_cluster: Any) -> None:
    cluster = sim_cluster()
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    messages = [{"role": "system", "content": "be brief"}, {"content": "hi"}]
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="default", messages=messages,  # type: ignore[arg-type]
                                           max_tokens=4, stream=stream)
        assert info.value.param == "messages[1].role", info.value
        assert "role" in info.value.message
    cluster.wait_pools_full()


def test_the_decoder_names_the_missing_field_and_keeps_other_params() -> None:
    with pytest.raises(BadRequest) as info:
        decode_body(b'{"messages": [{"content": "hi"}]}', ChatCompletionRequest)
    assert info.value.param == "messages[0].role"
    with pytest.raises(BadRequest) as info:
        decode_body(b'{"messages": [{"role": "user", "content": "hi"}], "n": 0}', ChatCompletionRequest)
    assert info.value.param == "n"
