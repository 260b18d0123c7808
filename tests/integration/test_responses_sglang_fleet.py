"""``/v1/responses`` on gateways with SGLang (``http://``) workers: served by the native workers of a mixed fleet
(the SGLang relay has no such route), answered 404 by a gateway relaying to SGLang workers alone, whose OpenAPI
document must then not offer it (a client generated from it would call a route that is never there)."""

from __future__ import annotations

import httpx
from pdtest import Procs, free_port, start_gateway, start_worker

SIM = ("--engine", "sim", "--num-pages", "256", "--page-size", "4")


def test_sglang_workers_alone_neither_serve_nor_document_responses(procs: Procs) -> None:
    bootstrap_port = free_port()
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
    decode = start_worker(procs, "decode", *SIM)
    port = start_gateway(procs, "--prefill", f"http://127.0.0.1:{prefill.http_port}", str(bootstrap_port),
                         "--decode", f"http://127.0.0.1:{decode.http_port}")
    base = f"http://127.0.0.1:{port}"
    r = httpx.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 4}, timeout=30)
    assert r.status_code == 404, r.text
    paths = httpx.get(f"{base}/openapi.json", timeout=30).json()["paths"]
    assert "/v1/chat/completions" in paths and "/v1/responses" not in paths, sorted(paths)
    # nor is there a response store to measure (nothing can be stored there)
    assert "pd_gateway_responses_stored" not in httpx.get(f"{base}/metrics", timeout=30).text


def test_a_mixed_fleet_serves_and_documents_responses(procs: Procs) -> None:
    prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(free_port()))
    decode = start_worker(procs, "decode", *SIM)
    bootstrap_port = free_port()
    http_prefill = start_worker(procs, "prefill", *SIM, "--bootstrap-embedded", str(bootstrap_port))
    http_decode = start_worker(procs, "decode", *SIM)
    port = start_gateway(procs, "--prefill", prefill.url, f"http://127.0.0.1:{http_prefill.http_port}",
                         str(bootstrap_port), "--decode", decode.url, f"http://127.0.0.1:{http_decode.http_port}",
                         "--api-key", "k")
    base, auth = f"http://127.0.0.1:{port}", {"authorization": "Bearer k"}
    r = httpx.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 4}, headers=auth, timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "response", r.text
    assert httpx.get(f"{base}/v1/responses/{r.json()['id']}", headers=auth, timeout=30).status_code == 200
    paths = httpx.get(f"{base}/openapi.json", headers=auth, timeout=30).json()["paths"]
    assert paths["/v1/responses"]["post"]["security"] == [{"apiKey": []}]
