"""The gateway's OpenAPI 3.1 document, served as ``GET /openapi.json``.

Built once by ``create_app`` (``openapi_document(config)`` -> bytes), never per request. Request bodies
are the JSON schemas of the msgspec structs the routes decode (``gateway/api_models.py``,
``gateway/admin.py``), so the document states what the decoder accepts; the few rules a decoder
cannot state (a required ``messages``, one of ``text``/``input_ids``) are added in ``_REQUIRED`` and
checked by ``gateway.api.Frontend``. Responses are the shapes ``gateway/responder.py`` and
``gateway/app.py`` write; every error status has the one OpenAI error shape of ``gateway/errors.py``.
Security schemes appear only where the configuration asks for keys (``--api-key``,
``--admin-api-key``, ``--metrics-require-admin``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec

from gateway.admin import NewWorker
from gateway.api_models import ChatCompletionRequest, CompletionRequest, GenerateRequest
from gateway.responses import ResponsesRequest

if TYPE_CHECKING:
    from gateway.runtime import GatewayConfig

OPENAPI_VERSION = "3.1.0"
_REF = "#/components/schemas/{name}"

# Rules the structs cannot carry (a default stands in so that Frontend can answer a clearer 400).
_REQUIRED: dict[str, dict[str, Any]] = {
    "ChatCompletionRequest": {"required": ["messages"]},
    "CompletionRequest": {"required": ["prompt"]},
    # (not both: a 400; a ``null`` one is absent)
    "GenerateRequest": {"oneOf": [{"required": ["text"], "properties": {"text": {"type": ["string", "array"]}}},
                                  {"required": ["input_ids"], "properties": {"input_ids": {"type": "array"}}}]},
    "ResponsesRequest": {"required": ["input"], "allOf": [{"properties": {"input": {"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1}]}}}]},
}

_INT = {"type": "integer"}
_STR = {"type": "string"}
_NULLABLE_STR = {"type": ["string", "null"]}
_USAGE = {
    "type": "object",
    "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
    "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                   "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}}},
}
_TOOL_CALL = {  # one call of an answer's ``message.tool_calls``: its arguments are JSON text, as OpenAI's
    "type": "object",
    "required": ["id", "type", "function"],
    "properties": {"id": _STR, "type": {"const": "function"},
                   "function": {"type": "object", "required": ["name", "arguments"],
                                "properties": {"name": _STR, "arguments": _STR}}},
}
_RESPONSES: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR, "code": _NULLABLE_STR},
        }},
    },
    "Usage": _USAGE,
    "Event": {  # one server-sent event of a stream
        "type": "object",
        "required": ["data"],
        "properties": {"data": {"type": "string", "description": "a JSON chunk (or an error), then [DONE]"}},
    },
    "ChatCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "chat.completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": {
                "type": "object",
                "required": ["index", "message", "finish_reason"],
                "properties": {
                    "index": _INT,
                    # (content null: an answer that is tool calls alone, gateway/tool_calls.py)
                    "message": {"type": "object", "required": ["role", "content"],
                                "properties": {"role": {"const": "assistant"}, "content": _NULLABLE_STR,
                                               "tool_calls": {"type": "array", "items": _TOOL_CALL}}},
                    "logprobs": {"type": ["object", "null"]},
                    "finish_reason": _NULLABLE_STR,
                },
            }},
            "usage": {"$ref": _REF.format(name="Usage")},
        },
    },
    "TextCompletion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "text_completion"}, "created": _INT, "model": _STR,
            "choices": {"type": "array", "items": {
                "type": "object",
                "required": ["index", "text", "finish_reason"],
                "properties": {"index": _INT, "text": _STR, "finish_reason": _NULLABLE_STR,
                               "logprobs": {"type": ["object", "null"]}},
            }},
            "usage": {"$ref": _REF.format(name="Usage")},
        },
    },
    "Response": {  # /v1/responses (gateway/responses.py): one output message
        "type": "object",
        "required": ["id", "object", "created_at", "status", "model", "output", "usage"],
        "properties": {
            "id": _STR, "object": {"const": "response"}, "created_at": _INT,
            "status": {"enum": ["completed", "incomplete"]},
            "incomplete_details": {"type": ["object", "null"], "properties": {"reason": _STR}}, "model": _STR,
            "output": {"type": "array", "items": {"anyOf": [
                {"type": "object", "required": ["id", "type", "role", "status", "content"],
                 "properties": {"id": _STR, "type": {"const": "message"}, "role": {"const": "assistant"},
                                "status": _STR, "content": {"type": "array", "items": {
                                    "type": "object", "required": ["type", "text"],
                                    "properties": {"type": {"const": "output_text"}, "text": _STR}}}}},
                {"type": "object", "required": ["id", "type", "call_id", "name", "arguments", "status"],
                 "properties": {"id": _STR, "type": {"const": "function_call"}, "call_id": _STR, "name": _STR,
                                "arguments": _STR, "status": _STR}},
            ]}},
            "usage": {"type": "object", "required": ["input_tokens", "output_tokens", "total_tokens"],
                      "properties": {"input_tokens": _INT, "output_tokens": _INT, "total_tokens": _INT}},
        },
    },
    "Generation": {
        "type": "object",
        "required": ["text", "output_ids", "meta_info"],
        "properties": {
            "text": _STR,
            "output_ids": {"type": "array", "items": _INT},
            "meta_info": {"type": "object", "required": ["id", "prompt_tokens", "completion_tokens"],
                          "properties": {"id": _STR, "prompt_tokens": _INT, "completion_tokens": _INT,
                                         "cached_tokens": _INT, "finish_reason": {"type": ["object", "null"]},
                                         "weight_version": _STR, "e2e_latency": {"type": "number"}}},
            "index": _INT,  # (a batch's: the item it answers)
        },
    },
    "GenerateResponse": {  # one prompt's answer, or a batch's list of them (item i at i)
        "anyOf": [{"$ref": _REF.format(name="Generation")},
                  {"type": "array", "items": {"$ref": _REF.format(name="Generation")}}],
    },
    "ModelList": {
        "type": "object",
        "required": ["object", "data"],
        "properties": {"object": {"const": "list"},
                       "data": {"type": "array", "items": {"$ref": _REF.format(name="Model")}}},
    },
    "Model": {
        "type": "object", "required": ["id", "object", "created", "owned_by"],
        "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR, "root": _STR,
                       "max_model_len": _INT},
    },
    "Worker": {
        "type": "object",
        "required": ["url", "role", "healthy"],
        "properties": {"url": _STR, "role": _STR, "healthy": {"type": "boolean"},
                       "connected": {"type": "boolean"}, "draining": {"type": "boolean"}, "error": _NULLABLE_STR},
    },
    "WorkerList": {
        "type": "object",
        "required": ["workers"],
        "properties": {"workers": {"type": "array", "items": {"$ref": _REF.format(name="Worker")}}},
    },
    "WorkerUrlList": {  # (SGLang router's /list_workers: its "urls", and the gateway's "workers")
        "type": "object",
        "required": ["urls", "workers"],
        "properties": {"urls": {"type": "array", "items": {"type": "string"}},
                       "workers": {"type": "array", "items": {"$ref": _REF.format(name="Worker")}}},
    },
    "Status": {
        "type": "object",
        "required": ["status", "ready", "policy", "active_requests", "queued_requests", "workers"],
        "properties": {
            "status": {"enum": ["ok", "unavailable", "draining"]}, "ready": {"type": "boolean"},
            "policy": _STR, "active_requests": _INT, "queued_requests": _INT,
            "workers": {"type": "array", "items": {"$ref": _REF.format(name="Worker")}},
        },
    },
}

_ERRORS = {
    "400": "invalid request: the error names the field in `param` where there is one",
    "401": "missing or wrong API key",
    "404": "unknown model, worker or stored response",
    "408": "the request body did not arrive within --body-timeout-s",
    "409": "the worker is already configured",
    "413": "the request body is too large (--max-body-bytes; 16 KiB for the admin API)",
    "429": "at capacity (--max-concurrent-requests, --max-queued-requests); see Retry-After",
    "502": "a worker failed the request",
    "503": "no worker can take it, or the gateway is shutting down",
    "504": "a worker did not answer in time",
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": _REF.format(name=name)}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: str) -> dict[str, Any]:
    return {code: _json(_ref("Error"), _ERRORS[code]) for code in codes}


def _generation(summary: str, request: str, response: str, operation_id: str,
                events: str = "server-sent events ending in `data: [DONE]`") -> dict[str, Any]:
    return {"post": {
        "operationId": operation_id,
        "summary": summary,
        "tags": ["generation"],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": f"the whole response; with `stream: true` {events} (an error after the first "
                                   "event is an `error` event)",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _ref("Event")}}},
            **_errors("400", "404", "408", "413", "429", "502", "503", "504"),
        },
    }}


def _query(name: str, description: str, *, required: bool = True) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": required, "description": description, "schema": _STR}


def _get(operation_id: str, summary: str, tag: str, responses: dict[str, Any]) -> dict[str, Any]:
    return {"get": {"operationId": operation_id, "summary": summary, "tags": [tag], "responses": responses}}


def _paths() -> dict[str, Any]:
    worker_url = _query("url", "the worker's native URL, pd://HOST:PORT")
    role = _query("role", "prefill, decode, or both (the default on a combined gateway)", required=False)
    created = {"201": _json(_ref("Worker"), "added: selectable once connected and passing probes"),
               **_errors("400", "409", "503")}
    created_from_body = {**created, **_errors("408", "413")}
    removed = {"202": _json(_ref("Worker"), "draining: no new requests, then it is gone"),
               **_errors("400", "404", "503")}
    workers = {"200": _json(_ref("WorkerList"), "every native worker"), **_errors("503")}
    response_id = {"name": "response_id", "in": "path", "required": True, "schema": _STR}
    return {
        "/v1/chat/completions": _generation("OpenAI chat completion", "ChatCompletionRequest", "ChatCompletion",
                                            "createChatCompletion"),
        "/v1/completions": _generation("OpenAI text completion", "CompletionRequest", "TextCompletion",
                                       "createCompletion"),
        "/generate": _generation("SGLang native generation", "GenerateRequest", "GenerateResponse", "generate"),
        "/v1/responses": _generation("OpenAI response (text and function tools; stored unless store is false, "
                                     "continued with previous_response_id)",
                                     "ResponsesRequest", "Response", "createResponse",
                                     "typed server-sent events (`event:` and `data:` lines), the last "
                                     "`response.completed` or `response.incomplete`, no `[DONE]`"),
        "/v1/responses/{response_id}": {
            "get": {"operationId": "retrieveResponse", "summary": "a stored response (this gateway process's memory; "
                    "only the key that created it reads it)", "tags": ["generation"],
                    "parameters": [response_id,
                                   {"name": "stream", "in": "query", "required": False, "description": "true (a "
                                    "background response's events, which this gateway has none of) is a 400",
                                    "schema": {"type": "boolean", "default": False}}],
                    "responses": {"200": _json(_ref("Response"), "the response object as it was answered"),
                                  **_errors("400", "404")}},
            "delete": {"operationId": "deleteResponse", "summary": "forget a stored response", "tags": ["generation"],
                       "parameters": [response_id],
                       "responses": {"200": _json({"type": "object", "required": ["id", "object", "deleted"],
                                                   "properties": {"id": _STR, "object": {"const": "response.deleted"},
                                                                  "deleted": {"const": True}}}, "deleted"),
                                     **_errors("404")}},
        },
        "/v1/responses/{response_id}/input_items": {"get": {
            "operationId": "listInputItems", "summary": "a stored response's input items (its conversation before "
            "its output: earlier turns' input and output, then its own input), a page at a time",
            "tags": ["generation"],
            "parameters": [response_id,
                           {"name": "limit", "in": "query", "required": False, "description": "items per page",
                            "schema": {"type": "integer", "minimum": 1, "maximum": 100, "default": 20}},
                           {"name": "order", "in": "query", "required": False, "description": "asc: as given",
                            "schema": {"enum": ["asc", "desc"], "default": "desc"}},
                           _query("after", "the id of the item the page starts after", required=False),
                           {"name": "include", "in": "query", "required": False, "description": "none supported: "
                            "any value is a 400", "schema": {"type": "array", "items": _STR, "maxItems": 0}}],
            "responses": {"200": _json({"type": "object", "required": ["object", "data", "first_id", "last_id",
                                                                       "has_more"],
                                        "properties": {"object": {"const": "list"},
                                                       "data": {"type": "array", "items": {"type": "object"}},
                                                       "first_id": {"type": ["string", "null"]},
                                                       "last_id": {"type": ["string", "null"]},
                                                       "has_more": {"type": "boolean"}}}, "a page of items"),
                          **_errors("400", "404")}}},
        "/v1/models": _get("listModels", "the served model", "generation",
                           {"200": _json(_ref("ModelList"), "the model"), **_errors("503")}),
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel", "summary": "the served model (also as 'default'); another is a 404",
            "tags": ["generation"], "parameters": [{"name": "model", "in": "path", "required": True, "schema": _STR}],
            "responses": {"200": _json(_ref("Model"), "the model"), **_errors("404", "503")}}},
        "/health": _get("health", "liveness, with every worker's state", "operations",
                        {"200": _json(_ref("Status"), "this process answers")}),
        "/readiness": _get("readiness", "200 only when a prefill and a decode (or a combined worker) are "
                           "selectable and the gateway is not draining", "operations",
                           {"200": _json(_ref("Status"), "ready"), "503": _json(_ref("Status"), "not ready")}),
        "/metrics": _get("metrics", "Prometheus metrics", "operations", {
            "200": {"description": "text exposition format", "content": {"text/plain": {"schema": _STR}}},
            **_errors("503")}),
        "/openapi.json": _get("openapi", "this document", "operations", {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            **_errors("503")}),
        "/workers": {
            **_get("listWorkers", "every native worker", "admin", workers),
            "post": {"operationId": "addWorker", "summary": "start routing to a worker", "tags": ["admin"],
                     "requestBody": {"required": True,
                                     "content": {"application/json": {"schema": _ref("NewWorker")}}},
                     "responses": created_from_body},
            "delete": {"operationId": "removeWorker", "summary": "drain a worker, then forget it", "tags": ["admin"],
                       "parameters": [worker_url], "responses": removed},
        },
        "/list_workers": _get("listWorkersAlias", "SGLang router's name for GET /workers (with its urls list)", "admin",
                              {"200": _json(_ref("WorkerUrlList"), "every worker"), **_errors("503")}),
        "/add_worker": {"post": {"operationId": "addWorkerAlias", "summary": "SGLang router's name for POST /workers",
                                 "tags": ["admin"], "parameters": [worker_url, role], "responses": created}},
        "/remove_worker": {"post": {"operationId": "removeWorkerAlias", "tags": ["admin"],
                                    "summary": "SGLang router's name for DELETE /workers", "parameters": [worker_url],
                                    "responses": removed}},
    }


_CLIENT_PATHS = ("/v1/chat/completions", "/v1/completions", "/generate", "/v1/responses",
                 "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items", "/v1/models",
                 "/v1/models/{model}", "/openapi.json")
_ADMIN_PATHS = ("/workers", "/list_workers", "/add_worker", "/remove_worker")


def _secure(paths: dict[str, Any], names: tuple[str, ...], scheme: str) -> None:
    for path in names:
        for operation in paths[path].values():
            operation["security"] = [{scheme: []}]
            operation["responses"].update(_errors("401"))


def openapi_document(config: GatewayConfig, *, serves_responses: bool = True) -> bytes:
    """The document for this configuration, encoded once. ``serves_responses``: ``/v1/responses`` is served (native
    workers; a gateway relaying to SGLang workers alone answers it 404, so it is not in the document)."""
    (_, components) = msgspec.json.schema_components(
        [ChatCompletionRequest, CompletionRequest, GenerateRequest, ResponsesRequest, NewWorker], ref_template=_REF)
    for name, extra in _REQUIRED.items():
        components[name].update(extra)
    components.update(_RESPONSES)
    paths = _paths()
    if not serves_responses:
        del paths["/v1/responses"], paths["/v1/responses/{response_id}"]
        del paths["/v1/responses/{response_id}/input_items"]
    schemes: dict[str, Any] = {}
    if config.api_keys:
        schemes["apiKey"] = {"type": "http", "scheme": "bearer", "description": "a client key (--api-key)"}
        _secure(paths, tuple(path for path in _CLIENT_PATHS if path in paths), "apiKey")
    if config.admin_api_keys:
        schemes["adminKey"] = {"type": "http", "scheme": "bearer", "description": "an admin key (--admin-api-key)"}
        _secure(paths, (*_ADMIN_PATHS, *(("/metrics",) if config.metrics_require_admin else ())), "adminKey")
    elif config.api_keys:  # (no admin key: the client keys guard the admin API)
        _secure(paths, _ADMIN_PATHS, "apiKey")
    doc: dict[str, Any] = {
        "openapi": OPENAPI_VERSION,
        "info": {"title": "pd-gateway", "version": "0.1.0",
                 "description": "OpenAI-compatible and SGLang routes in front of prefill/decode workers. Unknown "
                                "body fields are ignored; fields it does not implement (non-text content, audio, "
                                "hosted tools) are a 400 naming them unless at their neutral value, as are fields a "
                                "worker's engine cannot honour (penalties, tools and structured output on sim "
                                "workers). With SGLang (http://) workers the generation bodies go through as is."},
        "paths": paths,
        "components": {"schemas": components, **({"securitySchemes": schemes} if schemes else {})},
    }
    return msgspec.json.encode(doc)
