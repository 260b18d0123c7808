"""SGLang's ``/generate`` answers carry ``meta_info.e2e_latency`` (seconds from the request's arrival to its end)
once an item has finished, and ``meta_info.weight_version``, on the whole answer and on a stream's last event of
each item: clients read them unconditionally (e.g. the strands-agents SGLang model provider reports
``int(meta_info["e2e_latency"] * 1000)`` as its latency and raised a KeyError here), on our gateway and on a
worker's own SGLang side alike."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from pdtest import Procs, SimCluster, start_worker


def _events(client: httpx.Client, url: str, body: dict[str, object]) -> list[dict[str, object]]:
    with client.stream("POST", url, json={**body, "stream": True}) as reply:
        assert reply.status_code == 200
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _check(client: httpx.Client, url: str) -> None:
    single: dict[str, object] = {"text": "Hello world", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    batch: dict[str, object] = {"input_ids": [[1, 2], [3]], "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    for answer in [client.post(url, json=single).json(), *client.post(url, json=batch).json()]:
        meta = answer["meta_info"]
        assert isinstance(meta["e2e_latency"], float) and 0 <= meta["e2e_latency"] < 60, meta
        assert meta["weight_version"] == "default", meta
    for body in (single, batch):
        last: dict[object, dict[str, object]] = {}
        for event in _events(client, url, body):
            meta = event["meta_info"]
            assert isinstance(meta, dict) and meta["weight_version"] == "default", event
            assert ("e2e_latency" in meta) == (meta["finish_reason"] is not None), event  # (once finished)
            last[event.get("index", 0)] = meta
        assert len(last) == (1 if body is single else 2)
        assert all(isinstance(m["e2e_latency"], float) for m in last.values()), last


def test_the_gateways_generate_reports_e2e_latency(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    with httpx.Client(timeout=60) as client:
        _check(client, f"{cluster.base_url}/generate")


def test_a_workers_sglang_side_reports_e2e_latency(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "64")
    with httpx.Client(timeout=60) as client:
        _check(client, f"http://127.0.0.1:{worker.http_port}/generate")
