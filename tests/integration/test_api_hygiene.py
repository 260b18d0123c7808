"""API hygiene: repeatable worker flags, requests asking for what the gateway does not implement, and
bodies that are malformed (invalid UTF-8, not an object, wrong JSON types at every level, deep nesting).

A field that would change what a request means and that is not implemented (non-text inputs, ...) is a
400 naming it, never silently dropped; its neutral values still work. (Penalties, logit_bias and min_tokens
are implemented: tests/integration/test_sampling_surface.py; structured output and tools, which the sim
engine refuses by name: tests/integration/test_structured_output.py.)
Transport-level abuse (huge or slow bodies and heads) is in tests/integration/test_http_abuse.py.
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import msgspec
import openai
import pytest

from gateway.cli import build_parser, config_from_args

A, B, C, D = "pd://127.0.0.1:7001", "pd://127.0.0.1:7002", "pd://127.0.0.1:7003", "pd://127.0.0.1:7004"


@pytest.mark.parametrize(
    "argv",
    [
        ["--prefill", A, "--prefill", B, "--decode", C, "--decode", D],
        ["--prefill", A, B, "--decode", C, D],
        ["--prefill", A, "--decode", C, "--prefill", B, "--decode", D],
        ["--prefill", A, "--prefill", B, "--decode", C, D],
    ],
)
def test_prefill_and_decode_flags_repeat_or_take_several_urls(argv: list[str]) -> None:
    config = config_from_args(build_parser().parse_args(argv))
    assert config.prefill == (A, B)
    assert config.decode == (C, D)
    assert config.worker == ()


@pytest.mark.parametrize("argv", [["--worker", A, "--worker", B], ["--worker", A, B]])
def test_worker_flag_repeats_or_takes_several_urls(argv: list[str]) -> None:
    config = config_from_args(build_parser().parse_args(argv))
    assert config.worker == (A, B)
    assert config.prefill == config.decode == ()


def test_worker_flag_defaults_are_not_shared() -> None:
    parser = build_parser()
    assert config_from_args(parser.parse_args(["--prefill", A, "--decode", C])).prefill == (A,)
    assert config_from_args(parser.parse_args(["--prefill", B, "--decode", D])).prefill == (B,)
    assert parser.parse_args([]).prefill == parser.parse_args([]).worker == []


@pytest.mark.parametrize("argv", [["--prefill-policy", "cache_aware"], ["--decode-policy", "round_robin"],
                                  ["--policy", "cache_aware", "--policy-option", "prefill.cache_weight=50"]])
def test_combined_workers_take_one_policy(argv: list[str]) -> None:
    """Combined workers are chosen by one policy: a per-side one would be silently ignored."""
    with pytest.raises(ValueError, match="combined workers"):
        config_from_args(build_parser().parse_args(["--worker", A, *argv]))


def test_admin_keys_from_a_file(tmp_path: Any) -> None:
    keys = tmp_path / "admin-keys"
    keys.write_text("# operators\nadm1\n\n  adm2  \n")
    config = config_from_args(build_parser().parse_args(
        ["--prefill", A, "--decode", C, "--admin-api-key", "adm0", "--admin-api-key-file", str(keys)]))
    assert config.admin_api_keys == ("adm0", "adm1", "adm2")
    with pytest.raises(ValueError, match="admin_api_key_file: cannot read"):
        config_from_args(build_parser().parse_args(["--admin-api-key-file", str(tmp_path / "missing")]))


def client(cluster: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)


MESSAGES = [{"role": "user", "content": "Say hello."}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
FUNCTION = {"name": "f", "parameters": {"type": "object", "properties": {}}}
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}

# (keyword arguments for chat.completions.create, expected param)
CHAT_CASES: list[tuple[dict[str, Any], str]] = [
    ({"extra_body": {"regex": "[a-z]+"}}, "regex"),
    ({"extra_body": {"ebnf": 'root ::= "a"'}}, "ebnf"),
    ({"extra_body": {"json_schema": '{"type": "object"}'}}, "json_schema"),
    ({"tools": [TOOL], "tool_choice": "required"}, "tools"),  # constrained decoding: the sim engine has none
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"functions": [FUNCTION]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     "response_format.json_schema.schema"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"extra_body": {"audio": {"voice": "alloy", "format": "wav"}}}, "audio"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, IMAGE_PART]}]},
     "messages[0].content[1].type"),
    ({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [AUDIO_PART]}]},
     "messages[1].content[0].type"),
]

# (keyword arguments for completions.create, expected param)
COMPLETION_CASES: list[tuple[dict[str, Any], str]] = [
    ({"extra_body": {"regex": "[a-z]+"}}, "regex"),
    ({"suffix": " the end."}, "suffix"),
    ({"best_of": 3}, "best_of"),
]

# (raw /generate body, expected param)
GENERATE_CASES: list[tuple[dict[str, Any], str]] = [
    ({"text": "hi", "image_data": "data:image/png;base64,iVBORw0KGgo="}, "image_data"),
    ({"text": "hi", "image_data": ["https://example.invalid/cat.png"]}, "image_data"),
    ({"text": "hi", "audio_data": "x.wav"}, "audio_data"),
    ({"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "hi", "lora_path": "adapter"}, "lora_path"),
    ({"text": "hi", "sampling_params": {"regex": "[a-z]+"}}, "sampling_params.regex"),
    ({"text": "hi", "sampling_params": {"json_schema": '{"type": "object"}'}}, "sampling_params.json_schema"),
    ({"text": "hi", "sampling_params": {"ebnf": 'root ::= "a"'}}, "sampling_params.ebnf"),
    ({"text": "hi", "sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ({"text": "hi", "sampling_params": {"stop_regex": "a+"}}, "sampling_params.stop_regex"),
]


def _check_openai_400(info: pytest.ExceptionInfo[openai.BadRequestError], param: str) -> None:
    err = info.value.response.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param and info.value.param == param, err
    assert "not supported" in err["message"], err
    assert param.rsplit(".", 1)[-1] in err["message"] or "content parts" in err["message"], err


def test_unsupported_fields_are_a_400_naming_the_param(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    for kwargs in CHAT_CASES:
        args, param = dict(kwargs[0]), kwargs[1]
        messages = args.pop("messages", MESSAGES)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(model="sim", messages=messages, max_tokens=4, **args)
        _check_openai_400(info, param)
        with pytest.raises(openai.BadRequestError) as info:  # streaming requests are checked before any event
            c.chat.completions.create(model="sim", messages=messages, max_tokens=4, stream=True, **args)
        _check_openai_400(info, param)

    for kwargs in COMPLETION_CASES:
        args, param = dict(kwargs[0]), kwargs[1]
        with pytest.raises(openai.BadRequestError) as info:
            c.completions.create(model="sim", prompt="Once upon a time", max_tokens=4, **args)
        _check_openai_400(info, param)

    for body, param in GENERATE_CASES:
        r = httpx.post(f"{cluster.base_url}/generate", json={**body, "stream": False}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", (body, err)
        assert f"{param} is not supported" in err["message"], err

    # raw bodies the openai client would not send as-is
    url = f"{cluster.base_url}/v1/chat/completions"
    raw: list[tuple[dict[str, Any], str]] = [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
        ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "image": "x"}]}], "modalities": ["audio"]},
         "modalities"),  # fields before content
        ({"messages": MESSAGES, "presence_penalty": "high"}, "presence_penalty"),  # wrong type: still named
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        ({"messages": MESSAGES, "top_logprobs": 3, "logprobs": False, "stream": True}, "top_logprobs"),
        ({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True,
                                                                    "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),  # (vLLM's; it was ignored)
    ]
    for body, param in raw:
        r = httpx.post(url, json={**body, "max_tokens": 4}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)

    assert c.chat.completions.create(model="sim", messages=MESSAGES, max_tokens=4).choices[0].message.content  # type: ignore[arg-type]
    cluster.wait_pools_full()


def test_neutral_values_still_work(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster()
    c = client(cluster)
    plain = c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "Hello, world"}],
                                      max_tokens=8)
    text = plain.choices[0].message.content
    assert text

    parts = [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}]
    neutral = c.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": parts}], max_tokens=8,  # type: ignore[list-item]
        presence_penalty=0, frequency_penalty=0.0, logit_bias={}, response_format={"type": "text"},
        tool_choice="none", function_call="none", modalities=["text"],
        extra_body={"repetition_penalty": 1.0, "min_tokens": 0, "tools": [], "functions": []},
    )
    assert neutral.choices[0].message.content == text, "text parts are concatenated, neutral values change nothing"
    streamed = c.chat.completions.create(model="sim", messages=[{"role": "user", "content": parts}],  # type: ignore[list-item]
                                         max_tokens=8, stream=True, presence_penalty=0, tool_choice="none")
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == text

    base = c.completions.create(model="sim", prompt="Once upon a time", max_tokens=6).choices[0].text
    out = c.completions.create(model="sim", prompt="Once upon a time", max_tokens=6, presence_penalty=0,
                               frequency_penalty=0, logit_bias={}, best_of=1, suffix="",
                               extra_body={"repetition_penalty": 1})
    assert out.choices[0].text == base
    two = c.completions.create(model="sim", prompt="Once upon a time", max_tokens=6, n=2, best_of=2)
    assert [ch.text for ch in two.choices] == [base, base]

    r = httpx.post(f"{cluster.base_url}/generate", timeout=30, json={
        "text": "Once upon a time", "image_data": None, "return_hidden_states": False,
        "sampling_params": {"max_new_tokens": 6, "n": 1, "presence_penalty": 0.0, "frequency_penalty": 0,
                            "repetition_penalty": 1.0, "min_new_tokens": 0, "regex": None, "logit_bias": None},
    })
    assert r.status_code == 200, r.text
    assert r.json()["text"] == base
    cluster.wait_pools_full()


def test_null_means_the_default_and_vllm_spellings_of_off(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """OpenAI's schema lets every optional field be null (the client sends ``"logprobs": null`` for an
    argument left as None); vLLM takes ``top_k: 0`` as off and ``top_p: 0`` (OpenAI too) as the top
    token alone. Each answers as the default does."""
    cluster = sim_cluster()
    c = client(cluster)
    messages = [{"role": "user", "content": "Hello, world"}]
    text = c.chat.completions.create(model="sim", messages=messages, max_tokens=8).choices[0].message.content  # type: ignore[arg-type]
    nulls = {"logprobs": None, "n": None, "stream": None, "ignore_eos": None, "top_k": 0, "top_p": 0}
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=30,
                   json={"model": "sim", "messages": messages, "max_tokens": 8, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == text and r.json()["choices"][0]["logprobs"] is None
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=30, json={
        "model": "sim", "messages": messages, "max_tokens": 8, "stream": True,
        "stream_options": {"include_usage": None}})
    assert r.status_code == 200 and '"usage":{' not in r.text and r.text.endswith("data: [DONE]\n\n"), r.text
    r = httpx.post(f"{cluster.base_url}/v1/chat/completions", timeout=30, json={
        "model": "sim", "messages": messages, "max_tokens": 8, "stream_options": {"include_usage": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text  # (as OpenAI answers)
    base = c.completions.create(model="sim", prompt="Once upon a time", max_tokens=6).choices[0].text
    r = httpx.post(f"{cluster.base_url}/v1/completions", timeout=30, json={
        "prompt": "Once upon a time", "max_tokens": 6, **nulls, "logprobs": None, "echo": None})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == base, r.text
    r = httpx.post(f"{cluster.base_url}/generate", timeout=30, json={
        "text": "Once upon a time", "stream": None, "return_logprob": None,
        "sampling_params": {"max_new_tokens": 6, "top_k": 0}})
    assert r.status_code == 200 and r.json()["text"] == base, r.text
    cluster.wait_pools_full()


def test_models_by_id_and_errors_naming_the_clients_field(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """``GET /v1/models/{id}`` (the client's ``models.retrieve``); a 400 names the field as the client
    sent it: ``prompt`` on completions, ``max_completion_tokens`` when that was the one given."""
    cluster = sim_cluster()
    c = client(cluster)
    served = c.models.list().data[0]
    assert c.models.retrieve(served.id).id == served.id == c.models.retrieve("default").id
    with pytest.raises(openai.NotFoundError) as missing:
        c.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    cases = [
        ("/v1/completions", {"prompt": "x" * 9000, "max_tokens": 1}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * 9000}], "max_tokens": 1},
         "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9000},
         "max_completion_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 9000},
         "max_tokens"),
        ("/generate", {"text": "x" * 9000}, "text"),
        ("/generate", {"input_ids": [5] * 9000}, "input_ids"),
        ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 9000}}, "sampling_params.max_new_tokens"),
    ]
    for route, body, param in cases:
        r = httpx.post(f"{cluster.base_url}{route}", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, param, r.text)


def test_malformed_bodies_are_a_400_and_the_gateway_keeps_serving(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """Invalid UTF-8 (inside a string, where msgspec checks it lazily), a JSON array or scalar instead of
    an object, and chat messages with a role the template does not know: each a clear 400."""
    cluster = sim_cluster()
    routes = ("/v1/chat/completions", "/v1/completions", "/generate")
    bodies: list[tuple[bytes, str | None]] = [
        (b'{"messages": [{"role": "user", "content": "ab\xff\xfe"}], "prompt": "x\xffy", "text": "x\xffy"}', None),
        (b"\xff\xfe{}", None),
        (b'[{"role": "user", "content": "hi"}]', None),
        (b'"just a string"', None),
        (b"null", None),
        (b'{"messages": [{"role": "user", "content": "hi"}]' + b"]" * 3, None),
    ]
    with httpx.Client(base_url=cluster.base_url, timeout=30) as http:
        for route in routes:
            for body, param in bodies:
                r = http.post(route, content=body, headers={"content-type": "application/json"})
                assert r.status_code == 400, (route, body, r.text)
                err = r.json()["error"]
                assert err["type"] == "invalid_request_error" and err["param"] == param, (route, body, err)
        for role in ("wizard", "tool", "", "USER"):
            r = http.post("/v1/chat/completions", json={"messages": [{"role": role, "content": "hi"}], "max_tokens": 4})
            assert r.status_code == 400, (role, r.text)
            assert r.json()["error"]["param"] == "messages[0].role", r.text
        r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    cluster.wait_pools_full()


# Valid bodies per route; every field the published document gives a type gets a value of another type.
BASES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
                             "stream_options": {"include_usage": False}},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2, "stream": True, "stream_options": {"include_usage": False}},
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
}
_OF_TYPE: dict[str, Any] = {"object": {"x": 1}, "array": [1], "string": "s", "integer": 7, "number": 1.5,
                            "boolean": True, "null": None}


def _json_types(schema: dict[str, Any]) -> set[str] | None:
    """The JSON types ``schema`` allows, None for any (a field typed ``Any``)."""
    if "type" in schema:
        kinds = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        return set(kinds) | ({"integer"} if "number" in kinds else set())
    if "anyOf" in schema:
        found: set[str] = set()
        for option in schema["anyOf"]:
            kinds = _json_types(option)
            if kinds is None:
                return None
            found |= kinds
        return found
    if "enum" in schema:
        return {"string"}
    return None


def _wrong_type_cases(doc: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    components = doc["components"]["schemas"]

    def resolve(schema: dict[str, Any]) -> dict[str, Any]:
        return components[schema["$ref"].rsplit("/", 1)[1]] if "$ref" in schema else schema

    def nested(schema: dict[str, Any]) -> dict[str, Any] | None:
        """The object schema inside a property (directly, nullable, or as array items), if any."""
        schema = resolve(schema)
        for option in schema.get("anyOf", [schema]):
            option = resolve(option)
            if option.get("type") == "object" and "properties" in option:
                return option
            if option.get("type") == "array" and "$ref" in option.get("items", {}):
                return resolve(option["items"])
        return None

    cases = []

    def walk(route: str, body: dict[str, Any], target: dict[str, Any], schema: dict[str, Any], path: str) -> None:
        for name, prop in schema["properties"].items():
            kinds = _json_types(resolve(prop))
            if kinds is not None:
                wrong = next(v for k, v in _OF_TYPE.items() if k not in kinds)
                saved, target[name] = target.get(name, msgspec.UNSET), wrong
                cases.append((route, copy.deepcopy(body), f"{path}{name}"))
                if saved is msgspec.UNSET:
                    del target[name]
                else:
                    target[name] = saved
            inner = nested(prop)
            if inner is not None and name in target:
                child = target[name][0] if isinstance(target[name], list) else target[name]
                walk(route, body, child, inner, f"{path}{name}[0]." if isinstance(target[name], list)
                     else f"{path}{name}.")

    for route, base in BASES.items():
        request = doc["paths"][route]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body = copy.deepcopy(base)
        walk(route, body, body, resolve(request), "")
    return cases


def test_wrong_json_types_at_every_level_and_deep_nesting_are_a_400(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    """Every typed field of the published document (top level, messages[0], stream_options, sampling_params),
    given a value of another JSON type: a 400 naming exactly that field. Bodies nested deeper than the
    decoder recurses (inside fields typed Any, where nothing stops it early): a 400, not a 500."""
    cluster = sim_cluster()
    with httpx.Client(base_url=cluster.base_url, timeout=30) as http:
        cases = _wrong_type_cases(http.get("/openapi.json").json())
        assert len(cases) > 70, len(cases)
        assert {param for _, _, param in cases} >= {"messages[0].role", "messages[0].content",
                                                   "stream_options.include_usage", "sampling_params.top_k"}
        for route, body, param in cases:
            r = http.post(route, json=body)
            assert r.status_code == 400, (route, body, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == param, (route, param, err)
        deep = 5000  # (10 kB: within the admin API's body limit too)
        for route, field in (("/v1/chat/completions", "tool_choice"), ("/v1/completions", "bootstrap_room"),
                             ("/generate", "lora_path"), ("/workers", "url")):
            body = json.dumps(BASES.get(route, {"role": "decode"}))[:-1].encode()
            r = http.post(route, content=body + b', "' + field.encode() + b'": ' + b"[" * deep + b"]" * deep + b"}")
            assert r.status_code == 400, (route, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        for route, base in BASES.items():
            assert http.post(route, json=base).status_code == 200
    log = cluster.procs.log(f"gateway-{cluster.gateway_port}")
    assert "Traceback" not in log, log[-3000:]
    cluster.wait_pools_full()
