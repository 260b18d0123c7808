"""schemathesis against the gateway's own ``/openapi.json``, over a real gateway and real sim workers.

Every operation of the document gets a bounded number of generated requests, valid and invalid
(derandomized: the same cases each run). For each answer: no 5xx, the status and content type are
documented, JSON bodies match their schema, a request that breaks the schema is refused, and every
error is OpenAI-shaped. Removing workers is left out (the fuzzer would find and remove the real
ones: tests/integration/test_operations.py covers it); adding bogus ones is in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pdtest import SimCluster
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES_PER_OPERATION = 100
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
CONFIG = {
    "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}, "stateful": {"enabled": False}},
    "generation": {"mode": "all", "max-examples": EXAMPLES_PER_OPERATION},
    # 408/413 refuse a request as surely as a 400 does
    "checks": {"negative_data_rejection": {"expected-statuses": ["400", "401", "404", "405", "408", "409", "413",
                                                                 "429"]}},
}


def check_openai_error(response: Any) -> None:
    if response.status_code < 400:
        return
    content_type = response.headers.get("content-type", [""])[0]  # (schemathesis: every header as a list)
    assert content_type.startswith("application/json"), (response.status_code, content_type, response.text)
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error


def test_gateway_meets_its_openapi_document(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster(gateway_args=("--default-max-tokens", "8"))
    config = schemathesis.Config.from_dict(CONFIG)
    schema = schemathesis.openapi.from_url(f"{cluster.base_url}/openapi.json", config=config)
    schema = schema.exclude(operation_id=["removeWorker", "removeWorkerAlias"])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == 16  # (GET and DELETE /v1/responses/{id}, GET .../input_items among them)
    session = requests.Session()
    for operation in operations:
        cases = st.one_of(*(operation.as_strategy(mode) for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)))

        @settings(max_examples=EXAMPLES_PER_OPERATION, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(case=cases)
        def call(case: schemathesis.Case) -> None:
            response = case.call(session=session, timeout=30)
            case.validate_response(response, checks=CHECKS)
            check_openai_error(response)

        call()
    # the gateway still serves: a plain request after everything the fuzzer sent
    r = httpx.post(f"{cluster.base_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    for proc in cluster.procs.procs:  # and no error went unhandled anywhere
        log = cluster.procs.log(proc.name)  # type: ignore[attr-defined]
        assert "Traceback" not in log, log[-3000:]
