"""A stream whose decode dies once its prompt plus the tokens streamed so far no longer fit any prefill's KV pool
(a prefill holds only prompts: its pool may be the smaller): it cannot migrate, and ends as it would without
migration, with the decode's failure (a 502 error event, then ``[DONE]``), not with a 400 that blames the
client's request for a prompt it never sent. Real processes (sim engine)."""

from __future__ import annotations

import json
import os
import signal

import httpx
from pdtest import Procs, SimCluster, start_bootstrap, start_gateway, start_worker

PROMPT = [ord(c) for c in "A stream that outlives its decode worker."]  # 41 tokens


def test_a_stream_too_long_for_the_prefills_to_migrate_ends_with_its_decodes_failure(procs: Procs) -> None:
    boot = start_bootstrap(procs)
    common = ("--engine", "sim", "--transfer", "tcp", "--page-size", "4")
    prefill = start_worker(procs, "prefill", *common, "--num-pages", "16", bootstrap=boot)  # 64 tokens
    decodes = [start_worker(procs, "decode", *common, "--num-pages", "256", "--engine-option", "decode_step_s=0.05",
                            bootstrap=boot) for _ in range(2)]
    port = start_gateway(procs, "--prefill", prefill.url, "--decode", *[d.url for d in decodes])
    cluster = SimCluster(procs, boot, [prefill], decodes, port)
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": 60, "stream": True}
    text, errors, done, killed = "", [], False, False
    with httpx.stream("POST", f"{cluster.base_url}/v1/completions", json=body, timeout=60) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                errors.append(event["error"])
                continue
            text += "".join(choice["text"] for choice in event["choices"])
            if len(text) >= 30 and not killed:  # 41 + 30 tokens: more than the prefill's 64
                (busy,) = [d for d in decodes if d.get("/load")["num_running"]]  # type: ignore[index]
                os.kill(busy.proc.pid, signal.SIGKILL)
                killed = True
    assert killed and done and len(errors) == 1, (text, errors)
    assert errors[0]["type"] == "upstream_error" and errors[0]["code"] == "worker_gone", errors
    cluster.wait_pools_full(alive_only=True)
