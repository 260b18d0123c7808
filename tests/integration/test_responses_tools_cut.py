"""``/v1/responses``: a forced function call cut by ``max_output_tokens`` says so on its item, whole as streamed
(``status: incomplete``, as the response's), so an agent loop does not run a call whose arguments were cut."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from pdtest import Procs, SmolDeployment, start_smollm2, wait_pools_full

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmolDeployment]:
    procs = Procs(tmp_path_factory.mktemp("responses_tools"))
    try:
        yield start_smollm2(procs, chunk_size=64)
    finally:
        procs.stop_all()


def test_a_call_cut_by_the_budget_is_incomplete_whole_and_streamed(deployment: SmolDeployment) -> None:
    c = openai.OpenAI(base_url=f"{deployment.pd_url}/v1", api_key="none", max_retries=0, timeout=180)
    kw: dict[str, Any] = {"model": "default", "input": "What is the weather like in Paris?", "max_output_tokens": 3,
                          "temperature": 0, "tools": [TOOL], "tool_choice": {"type": "function", "name": "get_weather"}}
    events = list(c.responses.create(**kw, stream=True))
    streamed = events[-1].response  # type: ignore[union-attr]
    whole = c.responses.create(**kw)
    for response in (streamed, whole):
        assert response.status == "incomplete", response
        (call,) = response.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert call.status == "incomplete", response  # (its arguments are cut: not a call to run)
    assert whole.output[0].arguments == streamed.output[0].arguments  # type: ignore[union-attr]
    wait_pools_full(deployment.workers)
