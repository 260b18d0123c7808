"""Routing on real processes: load reports and KV events reach the gateway, cache_aware keeps a
prefix on one prefill, policy options are validated, and a third-party policy package routes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "pd-policy-sticky"


def tenant_prompt(tenant: int, turn: int) -> list[int]:
    # A 96-token "system prompt" per tenant, then a short unique question (page size 4 in sim clusters).
    return [(tenant * 37 + i) % 250 for i in range(96)] + [(turn * 13 + j) % 250 for j in range(5)]


def health(cluster) -> dict:  # type: ignore[no-untyped-def]
    return httpx.get(f"{cluster.base_url}/health", timeout=10).json()  # type: ignore[no-any-return]


def test_cache_aware_keeps_each_prefix_on_one_prefill_and_the_index_mirrors_the_workers(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=3, num_decode=1, gateway_args=("--policy", "cache_aware"))
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    cached = []
    for turn in range(4):
        for tenant in range(6):
            out = c.completions.create(model="sim", prompt=tenant_prompt(tenant, turn), max_tokens=2)
            assert out.usage is not None and out.usage.prompt_tokens_details is not None
            cached.append(out.usage.prompt_tokens_details.cached_tokens)
    first_turn, follow_ups = cached[:6], cached[6:]
    assert first_turn == [0] * 6
    assert all(n == 96 for n in follow_ups), f"every follow-up must hit its prefix on its prefill: {follow_ups}"
    stats = [w.get("/stats") for w in cluster.prefills]
    assert sum(s["num_cached_prompt_tokens"] for s in stats) == 96 * 18  # type: ignore[index]
    time.sleep(0.3)  # events of the last step
    by_url = {w["url"]: w for w in health(cluster)["workers"]}
    for worker, s in zip(cluster.prefills, stats, strict=True):
        assert by_url[worker.url]["cached_pages"] == s["num_cached_pages"], "the gateway's index equals the cache"  # type: ignore[index]
    assert sum(1 for s in stats if s["num_prompt_tokens"] > 0) >= 2, "new tenants spread over the prefills"  # type: ignore[index]
    cluster.wait_pools_full()


def test_load_reports_are_fresh_and_balance_back_to_zero(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=2, num_decode=2, gateway_args=("--policy", "power_of_two"))
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(6):
        c.completions.create(model="sim", prompt=tenant_prompt(i, 0), max_tokens=4)
    time.sleep(0.3)
    body = health(cluster)
    assert body["policy"] == "power_of_two"
    for w in body["workers"]:
        assert w["load_fresh"] is True, w
        assert (w["active"], w["prefill_tokens"], w["running_seqs"], w["waiting_seqs"]) == (0, 0, 0, 0), w
        assert w["free_pages"] == w["total_pages"] == 256, w
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert 'pd_gateway_worker_load_fresh{role="prefill"' in metrics
    assert "pd_gateway_worker_free_pages" in metrics

    # A frozen worker's report goes stale: the gateway says so and falls back to its own counts.
    frozen = cluster.prefills[0]
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(1.6)
        state = {w["url"]: w for w in health(cluster)["workers"]}[frozen.url]
        assert state["load_fresh"] is False and state["prefill_tokens"] == 0
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
    cluster.wait_pools_full()


def test_ratio_aware_reports_the_pd_load_ratio(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=1, num_decode=2, gateway_args=("--policy", "ratio_aware"))
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(4):
        c.completions.create(model="sim", prompt=tenant_prompt(i, 1), max_tokens=4)
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert 'pd_gateway_policy_stat{stat="ratio_aware.prefill_utilization"}' in metrics
    assert 'stat="ratio_aware.decode_utilization"' in metrics
    cluster.wait_pools_full()


@pytest.mark.parametrize(("args", "needle"), [
    (("--policy", "cache_aware", "--policy-option", "cache_weight=heavy"), "cache_weight"),
    (("--policy", "cache_aware", "--policy-option", "no_such=1"), "no_such"),
    (("--policy", "random", "--decode-policy", "nope"), "nope"),
    (("--policy", "ratio_aware", "--policy-option", "prefill.seed=1"), "prefill.seed"),
])
def test_bad_policy_configuration_stops_the_gateway_with_a_clear_error(args: tuple[str, ...], needle: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "gateway.cli", "--prefill", "pd://127.0.0.1:1", "--decode",
                           "pd://127.0.0.1:2", *args], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_example_plugin_package_installs_and_routes(sim_cluster, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(EXAMPLE, src)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(src)], check=True, timeout=300)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")])))
    contract = subprocess.run([sys.executable, "-m", "gateway.policies.contract", "sticky_prefix"],
                              capture_output=True, text=True, timeout=120)
    assert contract.returncode == 0, contract.stdout + contract.stderr
    cluster = sim_cluster(num_prefill=2, num_decode=1,
                          gateway_args=("--policy", "sticky_prefix", "--policy-option", "prefix_tokens=64"))
    assert health(cluster)["policy"] == "sticky_prefix"
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for turn in range(5):
        c.completions.create(model="sim", prompt=tenant_prompt(3, turn), max_tokens=2)
    served = [len(w.get("/debug/rooms")) for w in cluster.prefills]  # type: ignore[arg-type]
    assert sorted(served) == [0, 5], f"one home prefill for one prefix: {served}"
    metrics = httpx.get(f"{cluster.base_url}/metrics").text
    assert 'pd_gateway_policy_stat{stat="sticky_prefix.home_share"} 1.0' in metrics
    cluster.wait_pools_full()


def test_the_gateway_calls_every_hook(sim_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = sim_cluster(num_prefill=1, num_decode=2,
                          gateway_args=("--policy", "tests.integration.hook_policy:HookCounter"))
    c = openai.OpenAI(base_url=f"{cluster.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(3):
        c.completions.create(model="sim", prompt=tenant_prompt(i, 0), max_tokens=2)

    def counts() -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{cluster.base_url}/metrics").text.splitlines():
            if line.startswith('pd_gateway_policy_stat{stat="hook_counter.'):
                key = line.split('hook_counter.', 1)[1].split('"', 1)[0]
                out[key] = float(line.rsplit(" ", 1)[1])
        return out

    got = counts()
    assert got["added_prefill"] == 1 and got["added_decode"] == 2
    assert got["select"] == got["dispatch"] == got["finish_finished"] == 3
    victim = cluster.decodes[1]
    victim.proc.kill()
    victim.proc.wait()
    deadline = time.monotonic() + 10
    while counts().get("removed_decode", 0) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert counts().get("removed_decode") == 1
    c.completions.create(model="sim", prompt=tenant_prompt(9, 0), max_tokens=2)  # the other decode serves
    cluster.wait_pools_full(alive_only=True)


def test_decodes_with_pools_of_different_sizes_serve_what_each_can_hold(procs) -> None:  # type: ignore[no-untyped-def]
    """A long request goes to the decode whose pool holds it, whichever the policy's turn is; one no pool holds
    is the gateway's own 400 (before any worker saw it), naming the client's field."""
    from pdtest import start_bootstrap, start_gateway, start_worker, wait_pools_full

    boot = start_bootstrap(procs)
    common = ("--engine", "sim", "--page-size", "4")
    prefill = start_worker(procs, "prefill", *common, "--num-pages", "256", bootstrap=boot)
    small = start_worker(procs, "decode", *common, "--num-pages", "32", bootstrap=boot)  # 128 tokens
    big = start_worker(procs, "decode", *common, "--num-pages", "256", bootstrap=boot)  # 1,024 tokens
    port = start_gateway(procs, "--prefill", prefill.url, "--decode", small.url, big.url, "--policy", "round_robin")
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
    for i in range(6):  # 10 + 150 tokens: only the big decode
        out = c.completions.create(model="sim", prompt=[i + 1] * 10, max_tokens=150, extra_body={"ignore_eos": True})
        assert out.usage is not None and out.usage.completion_tokens == 150
        out = c.completions.create(model="sim", prompt=[i + 1] * 10, max_tokens=8)  # fits both: both serve
    assert all(w.get("/stats")["num_steps"] > 0 for w in (small, big))  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as err:
        c.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=1100)
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "context_length_exceeded" and body["param"] == "max_tokens"
    assert "the largest decode worker's pool holds 1024" in body["message"]
    for worker in (prefill, small, big):  # no worker saw it (a worker counts each request it refuses)
        text = httpx.get(f"http://127.0.0.1:{worker.http_port}/metrics", timeout=10).text
        assert "bad_request" not in text, [ln for ln in text.splitlines() if "bad_request" in ln]
        assert worker is prefill or 'pd_worker_requests_finished_total{reason="length"' in text
    wait_pools_full([prefill, small, big])
