"""Gateway overhead: CPU-µs per request and requests/s, against the workers driven directly.

Starts real processes: a bootstrap registry, a prefill and a decode sim worker with a zero-cost
latency model (so the numbers are the serving stack's own cost), a combined worker, and two
gateways (PD and combined). For each path it sends the same requests (max_tokens 16) with a fixed
concurrency and reads every process's CPU time from ``/proc/<pid>/stat`` before and after.

Rows:
- ``native -> combined worker``: the baseline, our native protocol straight to a worker (no HTTP).
- ``gateway -> combined worker``: the HTTP/OpenAI layer on top of it (non-streaming and SSE).
- ``gateway -> prefill + decode``: the full PD path (KV over the tcp backend).
- ``PD, policy X``: the same PD path through one more gateway per ``--policies`` entry (default
  ``random`` and ``cache_aware``), interleaved twice, so the routing policy's own cost (prefix
  hashing, index look-ups, load state) shows as the difference between those rows. CPU time comes
  in clock ticks (10 ms): use a few hundred requests or more per row.

    .venv/bin/python loadtests/bench_gateway.py [--requests 400] [--concurrency 8] [--policies random,cache_aware]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from pdtest import Procs, start_bootstrap, start_gateway, start_worker  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

from gateway.worker_client import WorkerClient  # noqa: E402
from workers.protocol import SamplingParams, StepOutput, Submit  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
ZERO_COST = ("--engine-option", "prefill_token_s=0", "--engine-option", "decode_step_s=0",
             "--engine-option", "decode_seq_s=0")
SENTENCE = "Benchmark prompt: the gateway's own cost per request, measured in CPU time. "
PROMPT = SENTENCE * 2  # --prompt-repeat sets the count
UNIQUE = [False]  # --unique: every request's prompt starts differently (no prefix-cache hits anywhere)
_counter = [0]


def prompt_text() -> str:
    if not UNIQUE[0]:
        return PROMPT
    _counter[0] += 1
    return f"{_counter[0]:08d} " + PROMPT


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


async def drive_native(url: str, requests: int, concurrency: int, max_tokens: int) -> None:
    client = WorkerClient(url, "both")
    client.start()
    assert await client.wait_ready(10)
    ids = list(PROMPT.encode())
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            sink: asyncio.Queue = asyncio.Queue()
            client.submit(Submit(0, ids, SamplingParams(max_new_tokens=max_tokens)), sink, None)
            while True:
                _, event = await sink.get()
                assert isinstance(event, StepOutput), event
                if event.finish_reason:
                    return

    await asyncio.gather(*(one() for _ in range(requests)))
    await client.aclose()


async def drive_http(base: str, requests: int, concurrency: int, max_tokens: int, stream: bool) -> None:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base, timeout=60, limits=limits) as http:
        async def one() -> None:
            async with sem:
                body = {"prompt": prompt_text(), "max_tokens": max_tokens, "stream": stream}
                if stream:
                    async with http.stream("POST", "/v1/completions", json=body) as r:
                        assert r.status_code == 200
                        async for _ in r.aiter_bytes():
                            pass
                else:
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text

        await asyncio.gather(*(one() for _ in range(requests)))


def measure(name: str, pids: dict[str, int], run) -> dict[str, float]:  # type: ignore[no-untyped-def]
    before = {k: cpu_s(p) for k, p in pids.items()}
    started = time.perf_counter()
    asyncio.run(run())
    wall = time.perf_counter() - started
    row = {k: cpu_s(p) - before[k] for k, p in pids.items()}
    row["wall"] = wall
    return row


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--policies", default="random,cache_aware", help="comma-separated: one extra PD gateway each")
    ap.add_argument("--prompt-repeat", type=int, default=2, help="prompt length in copies of the benchmark sentence")
    ap.add_argument("--unique", action="store_true",
                    help="a different prompt start per request: no cache hits, every prompt's pages new to the index")
    args = ap.parse_args()
    global PROMPT
    PROMPT = SENTENCE * max(1, args.prompt_repeat)
    UNIQUE[0] = args.unique
    n, conc, mt = args.requests, args.concurrency, args.max_tokens
    procs = Procs(Path(os.environ.get("TMPDIR", "/tmp")))
    try:
        boot = start_bootstrap(procs)
        common = ("--engine", "sim", "--num-pages", "1024", *ZERO_COST)
        prefill = start_worker(procs, "prefill", *common, bootstrap=boot, name="bench-prefill")
        decode = start_worker(procs, "decode", *common, bootstrap=boot, name="bench-decode")
        both = start_worker(procs, "both", *common, name="bench-both")
        pd_port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
        both_port = start_gateway(procs, "--worker", both.url)
        gw_pd, gw_both = procs.procs[-2].pid, procs.procs[-1].pid
        by_policy = {}
        for policy in filter(None, args.policies.split(",")):
            port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url, "--policy", policy)
            by_policy[policy] = (port, procs.procs[-1].pid)
        warm = 20
        for port in [pd_port, both_port, *(p for p, _ in by_policy.values())]:
            asyncio.run(drive_http(f"http://127.0.0.1:{port}", warm, conc, mt, False))
        rows = [
            ("native -> combined worker", None, both.proc.pid,
             measure("native", {"worker": both.proc.pid}, lambda: drive_native(both.url, n, conc, mt))),
            ("gateway -> combined worker", gw_both, both.proc.pid,
             measure("gw", {"gateway": gw_both, "worker": both.proc.pid},
                     lambda: drive_http(f"http://127.0.0.1:{both_port}", n, conc, mt, False))),
            ("gateway -> combined, SSE", gw_both, both.proc.pid,
             measure("gw-sse", {"gateway": gw_both, "worker": both.proc.pid},
                     lambda: drive_http(f"http://127.0.0.1:{both_port}", n, conc, mt, True))),
            ("gateway -> prefill + decode", gw_pd, None,
             measure("pd", {"gateway": gw_pd, "prefill": prefill.proc.pid, "decode": decode.proc.pid},
                     lambda: drive_http(f"http://127.0.0.1:{pd_port}", n, conc, mt, False))),
            ("gateway -> prefill + decode, SSE", gw_pd, None,
             measure("pd-sse", {"gateway": gw_pd, "prefill": prefill.proc.pid, "decode": decode.proc.pid},
                     lambda: drive_http(f"http://127.0.0.1:{pd_port}", n, conc, mt, True))),
        ]
        for _ in range(2):  # interleaved twice: the policies' rows share the machine's noise
            for policy, (port, pid) in by_policy.items():
                rows.append((f"PD, policy {policy}", pid, None,
                             measure(policy, {"gateway": pid, "prefill": prefill.proc.pid, "decode": decode.proc.pid},
                                     lambda port=port: drive_http(f"http://127.0.0.1:{port}", n, conc, mt, False))))
        print(f"\n{n} requests, concurrency {conc}, {len(PROMPT)}-token prompt{' (unique)' if UNIQUE[0] else ''}, "
              f"max_tokens {mt}, sim engine at zero "
              "cost (2-core shared machine: compare rows, not runs)\n")
        print(f"{'path':36} {'req/s':>8} {'gateway µs/req':>15} {'worker(s) µs/req':>17}")
        for name, _, _, row in rows:
            gw = row.get("gateway")
            workers = sum(v for k, v in row.items() if k in ("worker", "prefill", "decode"))
            gw_text = f"{gw / n * 1e6:15.0f}" if gw is not None else f"{'-':>15}"
            print(f"{name:36} {n / row['wall']:8.0f} {gw_text} {workers / n * 1e6:17.0f}")
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
