"""Whole-stack latency, one request at a time: PD (prefill + decode) against a combined worker.

Starts real processes: a bootstrap registry, a sim prefill and a sim decode worker (KV over the tcp
backend), a combined worker (``--role both``), and one gateway in front of each path. The sim engine
runs at zero model cost (``prefill_token_s=0 decode_step_s=0 decode_seq_s=0``), so what is measured
is the serving stack: HTTP, the native protocol, the scheduler loops, the PD handshake and the KV
transfer. ``--verify-kv 0`` also turns off the sim engine's KV row generation and checking
(``--engine-option verify_kv=0``), leaving only the stack.

Each row sends ``--requests`` requests strictly one after another (``max_tokens`` 16, non-streaming)
and prints latency p50/p99/mean:
- ``gateway -> prefill + decode`` / ``gateway -> combined``: through the real gateway (HTTP,
  ``/v1/completions``);
- ``native -> prefill + decode`` / ``native -> combined``: the same requests written straight to the
  workers over the native protocol (``gateway.worker_client.WorkerClient``), as the gateway does
  (decode and prefill submitted together with one bootstrap room): the workers' own latency, so
  gateway time = gateway row - native row.
Rows are interleaved ``--rounds`` times so they share the machine's noise; figures are over all rounds.

    .venv/bin/python loadtests/bench_worker.py [--requests 300] [--rounds 3] [--verify-kv 0]
    .venv/bin/python loadtests/bench_worker.py --profile /tmp/prof   # py-spy flame graphs of the PD workers
    .venv/bin/python loadtests/bench_worker.py --threads              # CPU and wake-ups per worker thread

``--profile DIR`` records the prefill and decode workers with py-spy (``pip install py-spy``) during
one extra native PD row and writes ``DIR/{prefill,decode}.svg`` (and ``.txt``, collapsed stacks).

``--threads`` runs one extra native row of each kind and prints, per worker thread, its CPU µs per
request and its voluntary / involuntary context switches per request (``/proc/<pid>/task/*``; names
from ``py-spy dump``). At one request at a time on one core, a request costs about the CPU of every
thread it passes through, and each hand-off between threads (a wake-up, then the GIL changing hands)
shows up as switches: this is where PD's cost over the combined worker is found.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from pdtest import Procs, start_bootstrap, start_gateway, start_worker  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

from gateway.worker_client import WorkerClient  # noqa: E402
from workers.protocol import BootstrapTarget, Error, SamplingParams, StepOutput, Submit  # noqa: E402

ZERO_COST = ("--engine-option", "prefill_token_s=0", "--engine-option", "decode_step_s=0",
             "--engine-option", "decode_seq_s=0")
SENTENCE = "Benchmark prompt: the gateway's own cost per request, measured in CPU time. "


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_http(base: str, prompt: str, requests: int, max_tokens: int) -> list[float]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": False}
    latencies = []
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        for _ in range(requests):
            started = time.perf_counter()
            r = await http.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - started)
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == max_tokens, r.text
    return latencies


async def _finish(sink: asyncio.Queue[tuple[str, object]], sides: set[str]) -> None:
    """Wait until every side in ``sides`` reported its finish."""
    while sides:
        side, event = await sink.get()
        if isinstance(event, Error) or not isinstance(event, StepOutput):
            raise RuntimeError(f"{side}: {event}")
        if event.finish_reason is not None:
            sides.discard(side)


async def run_native(urls: dict[str, str], prompt: str, requests: int, max_tokens: int) -> list[float]:
    """One request at a time straight to the workers: ``urls`` maps role -> native URL."""
    clients = {role: WorkerClient(url, role) for role, url in urls.items()}
    for client in clients.values():
        client.start()
        assert await client.wait_ready(10), f"{client.url} not ready"
    ids = list(prompt.encode())
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    latencies = []
    try:
        for _ in range(requests):
            sink: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
            started = time.perf_counter()
            if "prefill" in clients:
                info = clients["prefill"].info
                assert info is not None and info.bootstrap_host is not None
                target = BootstrapTarget(info.bootstrap_host, info.bootstrap_port, secrets.randbits(63),
                                         info.instance_id)
                clients["decode"].submit(Submit(0, ids, params, target), sink, "decode")
                clients["prefill"].submit(Submit(0, ids, params, target), sink, "prefill")
                await _finish(sink, {"decode", "prefill"})
            else:
                clients["both"].submit(Submit(0, ids, params), sink, "both")
                await _finish(sink, {"both"})
            latencies.append(time.perf_counter() - started)
    finally:
        for client in clients.values():
            await client.aclose()
    return latencies


def profile(out: Path, pids: dict[str, int], run: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """py-spy record ``pids`` while ``run`` goes; flame graphs and collapsed stacks land in ``out``."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out.mkdir(parents=True, exist_ok=True)
    spies = []
    for name, pid in pids.items():
        for fmt, ext in (("flamegraph", "svg"), ("raw", "txt")):
            spies.append(subprocess.Popen(
                [py_spy, "record", "--pid", str(pid), "--rate", "1000", "--threads", "--idle", "--format", fmt,
                 "--output", str(out / f"{name}.{ext}")],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
    time.sleep(1.0)  # py-spy attaches
    try:
        asyncio.run(run())
    finally:
        for spy in spies:
            spy.send_signal(2)  # SIGINT: py-spy writes its output and exits
        for spy in spies:
            spy.wait(30)
    print(f"profiles in {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


def thread_sample(pid: int) -> dict[int, tuple[int, int, int]]:
    """Per thread of ``pid``: (ns on CPU, voluntary, involuntary context switches)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns = int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except OSError:  # the thread ended
            continue
        switches = {k: int(v) for k, v in (line.split(":") for line in status.splitlines()
                                           if line.startswith(("voluntary_ctxt", "nonvoluntary_ctxt")))}
        out[int(tid)] = (ns, switches["voluntary_ctxt_switches"], switches["nonvoluntary_ctxt_switches"])
    return out


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by native id, from ``py-spy dump`` (the OS names them all "python")."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    try:
        dump = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    names = {}
    for line in dump.splitlines():
        if line.startswith("Thread "):  # Thread 1234 (idle): "scheduler-decode"
            tid, _, rest = line[len("Thread "):].partition(" ")
            names[int(tid, 0)] = rest.split('"')[1] if '"' in rest else rest
    return names


def thread_table(pids: dict[str, int], run: Callable[[], Coroutine[Any, Any, list[float]]]) -> None:
    """Run ``run`` once and print every thread's CPU µs and switches per request (threads idle during it left out)."""
    before = {name: thread_sample(pid) for name, pid in pids.items()}
    n = len(asyncio.run(run()))
    after = {name: thread_sample(pid) for name, pid in pids.items()}
    print(f"{'process':8} {'thread':32} {'CPU µs/req':>10} {'vol sw/req':>10} {'invol sw/req':>12}")
    for name, pid in pids.items():
        names, total = thread_names(pid), 0.0
        for tid, (ns, vol, invol) in sorted(after[name].items()):
            ns0, vol0, invol0 = before[name].get(tid, (0, 0, 0))
            cpu_us = (ns - ns0) / n / 1e3
            total += cpu_us
            if cpu_us >= 0.5 or vol > vol0:
                print(f"{name:8} {names.get(tid, str(tid))[:32]:32} {cpu_us:10.1f} {(vol - vol0) / n:10.2f} "
                      f"{(invol - invol0) / n:12.2f}")
        print(f"{name:8} {'(all threads)':32} {total:10.1f}")


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per row per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-repeat", type=int, default=2, help="prompt length in copies of the benchmark sentence")
    ap.add_argument("--verify-kv", type=int, choices=(0, 1), default=1,
                    help="sim engine KV row generation and verification (0: off, the stack alone)")
    ap.add_argument("--transfer", default="tcp", help="KV transfer backend of the PD pair")
    ap.add_argument("--profile", type=Path, default=None, help="py-spy the PD workers into this directory")
    ap.add_argument("--threads", action="store_true", help="CPU and context switches per worker thread per request")
    args = ap.parse_args()
    prompt = SENTENCE * max(1, args.prompt_repeat)
    n, mt = args.requests, args.max_tokens
    procs = Procs(Path(os.environ.get("TMPDIR", "/tmp")))
    try:
        boot = start_bootstrap(procs)
        common = ("--engine", "sim", "--num-pages", "1024", *ZERO_COST,
                  "--engine-option", f"verify_kv={args.verify_kv}")
        pd = ("--transfer", args.transfer)
        prefill = start_worker(procs, "prefill", *common, *pd, bootstrap=boot, name="bench-prefill")
        decode = start_worker(procs, "decode", *common, *pd, bootstrap=boot, name="bench-decode")
        both = start_worker(procs, "both", *common, name="bench-both")
        pd_port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
        both_port = start_gateway(procs, "--worker", both.url)
        pd_urls = {"prefill": prefill.url, "decode": decode.url}
        rows: dict[str, Callable[[int], Coroutine[Any, Any, list[float]]]] = {
            "gateway -> prefill + decode": lambda k: run_http(f"http://127.0.0.1:{pd_port}", prompt, k, mt),
            "gateway -> combined": lambda k: run_http(f"http://127.0.0.1:{both_port}", prompt, k, mt),
            "native -> prefill + decode": lambda k: run_native(pd_urls, prompt, k, mt),
            "native -> combined": lambda k: run_native({"both": both.url}, prompt, k, mt),
        }
        for run in rows.values():  # warm-up: connections, bootstrap caches, code paths
            asyncio.run(run(20))
        results: dict[str, list[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, run in rows.items():
                results[name] += asyncio.run(run(n))
        if args.profile is not None:
            profile(args.profile, {"prefill": prefill.proc.pid, "decode": decode.proc.pid},
                    lambda: run_native(pd_urls, prompt, n, mt))
        if args.threads:
            print(f"\nper thread, native -> prefill + decode, {n} requests one at a time:")
            thread_table({"prefill": prefill.proc.pid, "decode": decode.proc.pid},
                         lambda: run_native(pd_urls, prompt, n, mt))
            print(f"\nper thread, native -> combined, {n} requests one at a time:")
            thread_table({"both": both.proc.pid}, lambda: run_native({"both": both.url}, prompt, n, mt))
        print(f"\n{n} x {args.rounds} requests per row, one at a time, {len(prompt)}-token prompt, max_tokens {mt}, "
              f"sim engine at zero cost, verify_kv={args.verify_kv}, transfer {args.transfer}\n")
        print(f"{'path':30} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8}")
        for name, values in results.items():
            print(f"{name:30} {percentile(values, 0.5) * 1e3:8.2f} {percentile(values, 0.99) * 1e3:8.2f} "
                  f"{statistics.fmean(values) * 1e3:8.2f}")
        p50 = {name: percentile(values, 0.5) * 1e3 for name, values in results.items()}
        gw_pd, gw_both = p50["gateway -> prefill + decode"], p50["gateway -> combined"]
        native_pd, native_both = p50["native -> prefill + decode"], p50["native -> combined"]
        print(f"\nPD - combined through the gateway: {gw_pd - gw_both:+.2f} ms p50; the gateway's share of p50: "
              f"PD {gw_pd - native_pd:.2f} ms, combined {gw_both - native_both:.2f} ms")
    finally:
        procs.stop_all()


if __name__ == "__main__":
    main()
