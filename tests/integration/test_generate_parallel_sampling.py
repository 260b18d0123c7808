"""SGLang's ``/generate`` with ``sampling_params.n`` (parallel sampling, as RL rollout frameworks send it): each
prompt sampled ``n`` times, answered as a list (even for one prompt), prompt i's samples at items
i * n .. i * n + n - 1, each item its own ``meta_info.id``; streamed, each event names its item's ``index``. It
was a 400. On the gateway (PD) and on a worker's own SGLang side alike."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
from pdtest import Procs, SimCluster, start_worker, wait_pools_full
from sim_reference import expected_tokens

PROMPTS = [[5, 6, 7, 8, 9], [40, 41]]
GREEDY = {"max_new_tokens": 5, "temperature": 0}


def _check(client: httpx.Client, url: str) -> None:
    reply = client.post(url, json={"input_ids": PROMPTS[0], "rid": "R", "sampling_params": {**GREEDY, "n": 3}})
    assert reply.status_code == 200, reply.text
    items = reply.json()
    assert isinstance(items, list) and len(items) == 3
    assert [item["meta_info"]["id"] for item in items] == ["R_0", "R_1", "R_2"]
    for item in items:
        assert item["output_ids"] == expected_tokens(PROMPTS[0], 5), item
        assert item["meta_info"]["prompt_tokens"] == 5 and item["meta_info"]["completion_tokens"] == 5

    reply = client.post(url, json={"input_ids": PROMPTS, "sampling_params": {**GREEDY, "n": 2}})
    assert reply.status_code == 200, reply.text
    items = reply.json()
    assert [item["output_ids"] for item in items] == [expected_tokens(p, 5) for p in PROMPTS for _ in range(2)]
    assert [item["meta_info"]["prompt_tokens"] for item in items] == [5, 5, 2, 2]
    assert len({item["meta_info"]["id"] for item in items}) == 4

    with client.stream("POST", url, json={"input_ids": PROMPTS, "rid": ["a", "b"], "stream": True,
                                          "sampling_params": {**GREEDY, "n": 2}}) as stream:
        assert stream.status_code == 200
        lines = [line[6:] for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last: dict[int, dict[str, object]] = {}
    for event in map(json.loads, lines[:-1]):
        last[event["index"]] = event
    assert sorted(last) == [0, 1, 2, 3]
    assert [last[i]["output_ids"] for i in range(4)] == [expected_tokens(p, 5) for p in PROMPTS for _ in range(2)]
    assert [last[i]["meta_info"]["id"] for i in range(4)] == ["a_0", "a_1", "b_0", "b_1"]  # type: ignore[index]

    too_many = client.post(url, json={"input_ids": PROMPTS, "sampling_params": {**GREEDY, "n": 40}})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "sampling_params.n", too_many.text
    zero = client.post(url, json={"input_ids": PROMPTS[0], "sampling_params": {**GREEDY, "n": 0}})
    assert zero.status_code == 400 and "sampling_params.n" in zero.text, zero.text


def test_the_gateways_generate_samples_each_prompt_n_times(sim_cluster: Callable[..., SimCluster]) -> None:
    cluster = sim_cluster()
    with httpx.Client(timeout=60) as client:
        _check(client, f"{cluster.base_url}/generate")
    cluster.wait_pools_full()


def test_a_workers_sglang_side_samples_each_prompt_n_times(procs: Procs) -> None:
    worker = start_worker(procs, "both", "--engine", "sim", "--num-pages", "64", "--page-size", "4")
    with httpx.Client(timeout=60) as client:
        _check(client, f"http://127.0.0.1:{worker.http_port}/generate")
    wait_pools_full([worker])
