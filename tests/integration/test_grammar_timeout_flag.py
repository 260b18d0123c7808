"""``pd-worker --grammar-timeout-s``: through a real gateway and torch worker (a tiny random model), a
response_format whose grammar compiles past the limit is a 400 naming the field and saying why, the next
request's grammar is served, and every KV page is free again. The flag is checked like every timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pdtest import Procs, Worker, start_gateway, start_worker, tiny_model_with_tokenizer, wait_pools_full

from workers.cli import build_parser, config_from_args
from workers.config import ConfigError
from workers.grammar import GRAMMAR_TIMEOUT_S

pytestmark = pytest.mark.slow
pytest.importorskip("llguidance")

# A schema the gateway passes on (under its 256 KiB grammar cap) that takes seconds to compile on the worker with
# this vocabulary (5,000 optional properties: ~3 s), ten times the limit below
SLOW_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(5000)}}


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Worker]]:
    tmp = tmp_path_factory.mktemp("grammar-timeout")
    model = tmp / "model"
    model.mkdir()
    tiny_model_with_tokenizer(model)
    procs = Procs(tmp)
    try:
        worker = start_worker(procs, "both", "--engine", "torch", "--model", str(model), "--num-pages", "64",
                              "--grammar-timeout-s", "0.3")
        port = start_gateway(procs, "--worker", worker.url)
        yield f"http://127.0.0.1:{port}", worker
    finally:
        procs.stop_all()


def chat(base: str, schema: dict[str, Any]) -> httpx.Response:
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    body = {"model": "default", "messages": [{"role": "user", "content": "JSON please"}], "max_tokens": 8,
            "temperature": 0, "response_format": response_format}
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=120)


def test_a_grammar_past_the_limit_is_a_400_and_the_worker_goes_on(deployment: tuple[str, Worker]) -> None:
    base, worker = deployment
    slow = chat(base, SLOW_SCHEMA)
    assert slow.status_code == 400, slow.text
    error = slow.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "took too long to compile" in error["message"] and "--grammar-timeout-s" in error["message"]
    quick = chat(base, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert quick.status_code == 200, quick.text
    assert quick.json()["choices"][0]["message"]["content"].startswith('{"a": ')
    wait_pools_full([worker])
    text = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=10).text
    (held,) = [line for line in text.splitlines() if line.startswith("pd_worker_queue_requests{") and
               'queue="grammar"' in line]
    assert float(held.rsplit(" ", 1)[1]) == 0  # nobody left in stage "grammar"


def test_the_flag_is_checked() -> None:
    assert config_from_args(build_parser().parse_args([])).grammar_timeout_s == GRAMMAR_TIMEOUT_S
    assert config_from_args(build_parser().parse_args(["--grammar-timeout-s", "2.5"])).grammar_timeout_s == 2.5
    for bad in ("0", "-1", "nan", "inf"):
        with pytest.raises(ConfigError, match="grammar_timeout_s"):
            config_from_args(build_parser().parse_args(["--grammar-timeout-s", bad]))
    assert "--grammar-timeout-s" in build_parser().format_help()
