"""``pd-cluster`` supervision with real processes: restarts on the same ports, crash loops, shutdown.

Every test goes through ``cluster_run`` (``test_cluster_cli.py``), which reaps pd-cluster and every
child it has seen even when the test fails.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import pytest
from pdtest import wait_http_ok
from test_cluster_cli import ClusterRun, cluster_run

pytestmark = pytest.mark.timeout(90)


def arg(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def decodes(run: ClusterRun) -> dict[str, tuple[int, list[str]]]:
    """Live decode workers by their pd-cluster name (decode-i is the i-th ``--decode`` URL of the gateway)."""
    children = run.children()
    gateway = next(argv for argv in children.values() if "gateway.cli" in argv)
    urls = gateway[gateway.index("--decode") + 1:]
    urls = urls[:next((i for i, u in enumerate(urls) if u.startswith("--")), len(urls))]
    found = {}
    for pid, argv in children.items():
        if "workers.cli" in argv and arg(argv, "--role") == "decode":
            url = "pd://127.0.0.1:" + arg(argv, "--port")
            found[f"decode-{urls.index(url)}"] = (pid, argv)
    return found


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def chat(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert reply.usage is not None and reply.usage.completion_tokens == 4


def test_killed_decode_is_restarted_on_its_ports_and_serves_again(tmp_path: Path) -> None:
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "2", "--num-pages", "256") as run:
        run.wait_ready()
        client = openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=30)
        chat(client)
        name, (pid, argv) = sorted(decodes(run).items())[0]
        http_port, port = arg(argv, "--http-port"), arg(argv, "--port")
        os.kill(pid, signal.SIGKILL)
        for _ in range(4):  # the other decode serves at once
            chat(client)
        run.wait_log(f"pd-cluster: {name} exited with code -9 (SIGKILL); restart 1 (1/5 within 60s)")
        run.wait_log(f"pd-cluster: {name} is healthy again after restart 1")
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 20)
        new_pid, new_argv = decodes(run)[name]
        assert new_pid != pid and new_argv == argv, "same argv, so the same ports"
        deadline = time.monotonic() + 20  # the gateway reconnects to the same URL by itself
        while not any(w["url"] == f"pd://127.0.0.1:{port}" and w["healthy"]
                      for w in get_json(f"{run.url}/health")["workers"]):
            assert time.monotonic() < deadline, get_json(f"{run.url}/health")
            time.sleep(0.2)
        for _ in range(6):
            chat(client)
        assert get_json(f"http://127.0.0.1:{http_port}/stats")["num_steps"] > 0, "the restarted decode served"
        assert run.proc.poll() is None and len(run.children()) == 5


def test_crash_looping_child_stops_the_cluster_non_zero(tmp_path: Path) -> None:
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64",
                     "--max-restarts", "2", "--restart-backoff-s", "0.2") as run:
        run.wait_ready()
        name = next(iter(decodes(run)))
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        while run.proc.poll() is None:  # kill the decode, then each restart of it as soon as it is spawned
            assert time.monotonic() < deadline, run.log()
            for pid, argv in run.children().items():
                if pid not in killed and "workers.cli" in argv and arg(argv, "--role") == "decode":
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
            time.sleep(0.02)
        assert run.proc.wait() == 1 and len(killed) == 3
        log = run.log()
        assert f"pd-cluster: {name} exited with code -9 (SIGKILL); restart 1 (1/2 within 60s) in 0.2s" in log
        assert f"pd-cluster: {name} exited with code -9 (SIGKILL); restart 2 (2/2 within 60s) in 0.4s" in log
        assert (f"pd-cluster: {name} exited with code -9 (SIGKILL) after 2 restarts within 60s (--max-restarts 2): "
                "crash loop, stopping the cluster") in log
        assert "healthy again" not in log
        run.wait_children_gone()


def test_sigterm_during_restart_backoff_reaps_everything(tmp_path: Path) -> None:
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64",
                     "--restart-backoff-s", "30") as run:
        run.wait_ready()
        name, (pid, _) = next(iter(decodes(run).items()))
        os.kill(pid, signal.SIGKILL)
        run.wait_log(f"{name} exited with code -9 (SIGKILL); restart 1 (1/5 within 60s) in 30.0s")
        started = time.monotonic()
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(20) == 0
        assert time.monotonic() - started < 15, "did not wait out the backoff"
        run.wait_children_gone()
        assert len(run.seen) == 4, f"nothing may be respawned: {run.seen}"


def test_sigterm_during_startup_reaps_everything(tmp_path: Path) -> None:
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64") as run:
        deadline = time.monotonic() + 30
        while not any("workers.cli" in argv for argv in run.children().values()):
            assert time.monotonic() < deadline and run.proc.poll() is None, run.log()
            time.sleep(0.02)
        run.proc.send_signal(signal.SIGTERM)
        assert run.proc.wait(20) == 0
        assert "pd-cluster ready" not in run.log()
        run.wait_children_gone()


def test_restarted_registry_gets_the_prefill_registered_again(tmp_path: Path) -> None:
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64") as run:
        run.wait_ready()
        pid, argv = next((p, a) for p, a in run.children().items() if "bootstrap.cli" in a)
        route = (f"http://127.0.0.1:{arg(argv, '--port')}/route"
                 "?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        assert "page_size" in get_json(route)
        os.kill(pid, signal.SIGKILL)
        run.wait_log("pd-cluster: bootstrap is healthy again after restart 1")
        wait_http_ok(route, 15)  # 503 until the prefill's next heartbeat registers it with the new registry
        chat(openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=30))


def test_sigterm_lets_the_gateway_drain_before_the_workers_stop(tmp_path: Path) -> None:
    """A stream open when pd-cluster is told to stop finishes: the gateway drains first, with its workers
    still serving it (they were stopped together: the stream ended with a 'no healthy worker' error)."""
    import httpx

    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "256",
                     "--engine-option", "decode_step_s=0.02") as run:
        run.wait_ready()
        with httpx.stream("POST", f"{run.url}/v1/completions", timeout=30, json={
                "prompt": "drain me", "max_tokens": 100, "stream": True}) as stream:  # 2 s at least
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            run.proc.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest), rest[-3:]
        assert run.proc.wait(30) == 0
        run.wait_children_gone()


def test_a_gateway_draining_on_its_own_is_not_killed_as_dead(tmp_path: Path) -> None:
    """The gateway alone told to stop (by an operator, say): its listener closes while it drains, and
    its liveness check finds nothing there. That is a process stopping, not a frozen one: it finishes its
    open stream and exits, then is restarted (it was killed 3 checks in, the stream cut mid-body)."""
    import httpx

    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "256", "--liveness-interval-s",
                     "0.3", "--engine-option", "decode_step_s=0.03") as run:
        run.wait_ready()
        (gateway,) = [pid for pid, argv in run.children().items() if "gateway.cli" in argv]
        with httpx.stream("POST", f"{run.url}/v1/completions", timeout=30, json={
                "prompt": "drain me", "max_tokens": 120, "stream": True}) as stream:  # 3.6 s at least
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            os.kill(gateway, signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and any('"finish_reason":"length"' in line for line in rest), rest[-3:]
        run.wait_log("pd-cluster: gateway exited with code", 30)
        assert "liveness checks" not in run.log()
        run.wait_ready()  # restarted


@pytest.mark.parametrize("how", [signal.SIGHUP, signal.SIGKILL])
def test_a_hung_up_or_killed_supervisor_leaves_no_children(tmp_path: Path, how: signal.Signals) -> None:
    """The children live in their own sessions (a terminal's Ctrl-C reaches only pd-cluster): a hang-up
    stops the cluster as SIGTERM does, and a SIGKILLed pd-cluster's children get SIGTERM from the kernel
    (they kept running, holding their ports)."""
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64") as run:
        run.wait_ready()
        assert len(run.children()) == 4
        run.proc.send_signal(how)
        run.proc.wait(60)
        run.wait_children_gone(40)


def test_a_running_but_frozen_worker_is_restarted(tmp_path: Path) -> None:
    """A child that no longer answers its liveness check (frozen here; a worker whose scheduler died
    answers 503) is restarted after three failed checks in a row: it stayed in place, the cluster at 503."""
    with cluster_run(tmp_path, "--prefill", "1", "--decode", "1", "--num-pages", "64",
                     "--liveness-interval-s", "1") as run:
        run.wait_ready()
        name, (pid, _) = next(iter(decodes(run).items()))
        os.kill(pid, signal.SIGSTOP)
        run.wait_log(f"pd-cluster: {name} failed 3 liveness checks in a row", 30)
        run.wait_log(f"pd-cluster: {name} is healthy again after restart 1", 30)
        assert decodes(run)[name][0] != pid
        deadline = time.monotonic() + 20
        while True:  # the gateway reconnects to the restarted decode by itself
            try:
                chat(openai.OpenAI(base_url=f"{run.url}/v1", api_key="none", max_retries=0, timeout=10))
                break
            except openai.APIError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
