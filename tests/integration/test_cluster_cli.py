"""``pd-cluster`` as a user runs it: the real command, the real openai client, clean shutdown."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
from pdtest import free_port, wait_http_ok


def child_pids(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_pd_cluster_serves_openai_and_cleans_up_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    log = open(tmp_path / "cluster.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cluster", "--engine", "sim", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/health", 120, proc)
        deadline = time.monotonic() + 30
        while b"pd-cluster ready" not in (tmp_path / "cluster.log").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        whole = c.chat.completions.create(model="sim", messages=messages, max_tokens=8)  # type: ignore[arg-type]
        assert whole.choices[0].message.content and whole.usage and whole.usage.completion_tokens == 8
        pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="sim", messages=messages, max_tokens=8, stream=True) if ch.choices]  # type: ignore[arg-type]
        assert "".join(pieces) == whole.choices[0].message.content
        children = child_pids(proc.pid)
        assert len(children) == 4, f"bootstrap + prefill + decode + gateway, got {children}"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children):
            assert time.monotonic() < deadline, "children outlived pd-cluster"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        for pid in child_pids(proc.pid):
            os.kill(pid, signal.SIGKILL)
