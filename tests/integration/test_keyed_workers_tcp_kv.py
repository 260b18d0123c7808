"""Two real worker processes with the workers' key (``pd-worker --api-key``) and ``--same-host-kv off``: their KV
moves over the tcp backend's data port, whose connections prove the key (``transfer.auth``), and a request is
served end to end through a keyed gateway; the prefill's KV metrics show the tcp path and no refusal."""

from __future__ import annotations

import httpx
import openai
from pdtest import start_bootstrap, start_gateway, start_worker


def test_a_keyed_pair_moves_kv_over_the_tcp_data_port(procs) -> None:  # type: ignore[no-untyped-def]
    registry = start_bootstrap(procs)
    sim = ("--engine", "sim", "--num-pages", "64", "--page-size", "4", "--api-key", "w0rker",
           "--same-host-kv", "off")
    prefill = start_worker(procs, "prefill", *sim, bootstrap=registry)
    decode = start_worker(procs, "decode", *sim, bootstrap=registry)
    gateway = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url, "--worker-api-key", "w0rker")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{gateway}/v1", api_key="none", max_retries=0, timeout=60)
    for prompt in ("keyed tcp", "keyed tcp again, a second room over the same connections"):
        assert c.completions.create(model="sim", prompt=prompt, max_tokens=3).choices[0].finish_reason == "length"
    metrics = httpx.get(f"http://127.0.0.1:{prefill.http_port}/metrics",
                        headers={"authorization": "Bearer w0rker"}, timeout=10).text
    assert 'pd_worker_kv_peers{path="shm",role="prefill"} 0.0' in metrics, "--same-host-kv off: no shm"
    assert 'pd_worker_kv_peers{path="tcp",role="prefill"} 1.0' in metrics, metrics
