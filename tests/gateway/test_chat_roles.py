"""OpenAI's ``developer`` role is its newer name for ``system``: with a chat template that knows only
``system`` (SmolLM2's, like most), a developer message is rendered as a system one, not as a role the
model never saw (the template would also add its default system prompt in front of it)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from gateway.api import Frontend
from gateway.api_models import ChatCompletionRequest
from gateway.hf_tokenizer import HFTokenizer


@pytest.fixture(scope="module")
def frontend() -> Frontend:
    pytest.importorskip("gguf")
    from workers.engines.llama.gguf_convert import default_model_dir

    return Frontend(None, HFTokenizer.from_dir(default_model_dir()), "m", 8192)  # type: ignore[arg-type]


def ids(frontend: Frontend, messages: list[dict[str, Any]]) -> list[int]:
    request = msgspec.convert({"messages": messages}, ChatCompletionRequest)
    return frontend.prepare_chat(request).input_ids


def test_developer_messages_render_as_system_ones(frontend: Frontend) -> None:
    user = {"role": "user", "content": "Hi"}
    as_system = ids(frontend, [{"role": "system", "content": "Answer briefly."}, user])
    assert ids(frontend, [{"role": "developer", "content": "Answer briefly."}, user]) == as_system
    text = frontend.tokenizer.decode(as_system)
    assert "developer" not in text and "Answer briefly." in text


def test_a_template_that_knows_developer_keeps_it(frontend: Frontend) -> None:
    tokenizer: Any = frontend.tokenizer
    original = tokenizer.chat_template
    tokenizer.chat_template = original.replace("{% for message in messages %}",
                                               "{# developer is a role of its own here #}{% for message in messages %}")
    try:
        text = frontend.tokenizer.decode(ids(frontend, [{"role": "developer", "content": "Answer briefly."}]))
    finally:
        tokenizer.chat_template = original
    assert "developer" in text
