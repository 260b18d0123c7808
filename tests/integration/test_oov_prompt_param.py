"""A prompt of token ids the model has no embedding for is refused by the worker (it knows the model's vocabulary;
the gateway's tokenizer may know fewer ids than the model holds): its 400 names the client's prompt field, as every
other refusal names its field; it named none."""

from __future__ import annotations

import httpx
import openai
import pytest


def test_an_out_of_vocabulary_prompt_id_is_a_400_naming_the_prompt(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    client = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=30)
    for prompt in ([5, 2147483647], [[7, 8], [9, 1 << 20]]):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="sim", prompt=prompt, max_tokens=2)  # type: ignore[arg-type]
        error = info.value.body
        assert isinstance(error, dict) and error.get("param") == "prompt", error
        assert "token ids must be in" in str(error.get("message")), error
    r = httpx.post(f"{cluster.base_url}/generate", json={"input_ids": [3, 999999], "sampling_params": {
        "max_new_tokens": 2}}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text
    cluster.wait_pools_full()
