"""Soak run: a local PD cluster under steady load for many minutes; nothing may grow beyond noise.

It starts ``pd-cluster --engine sim`` (registry, prefills, decodes, gateway; zero model cost unless
``--model-cost``), then keeps ``--concurrency`` users busy, half on streaming chat and half on
non-streaming completions, each with a fresh connection every ``--reconnect-every`` requests. Once a
minute (``--window-s``) it prints requests, errors, latency p50/p99 for each kind, TTFT p50/p99, and
the RSS of every process of the cluster. At the end: RSS at start (after the first window) and at the
end per process, every KV pool back to full, and a verdict:

* RSS of a process grew by more than ``max(--rss-slack-pct of it, --rss-slack-mib)``: FAIL;
* any request failed: FAIL;
* a process of the cluster exited during the run (even one ``pd-cluster`` restarted): FAIL;
* a KV page still held once idle: FAIL.
Latency trends are printed, not judged (this machine is noisy).

    python loadtests/soak.py --minutes 10 --prefill 2 --decode 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from gateway.cluster import free_port  # noqa: E402
from loadtests.load_client import HttpTarget, Result, closed_loop, percentile  # noqa: E402
from loadtests.stop_signals import stop_like_ctrl_c  # noqa: E402

PROMPT = "Tell me about the history of the bicycle in a few sentences."


def get_json(url: str) -> object:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return float("nan")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (by parent pid)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
        parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


@dataclass
class Proc:
    pid: int
    name: str
    http_port: int | None = None  # workers: their HTTP side (KV pool state)


def cluster_procs(root: int) -> list[Proc]:
    procs = [Proc(root, "pd-cluster")]
    for pid in descendants(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv if a]
        text = " ".join(args)
        if "workers.cli" in text or "pd-worker" in text:
            role = args[args.index("--role") + 1] if "--role" in args else "worker"
            port = int(args[args.index("--http-port") + 1]) if "--http-port" in args else None
            procs.append(Proc(pid, f"{role}-{pid}", port))
        elif "gateway" in text:
            procs.append(Proc(pid, "gateway"))
        elif "bootstrap" in text:
            procs.append(Proc(pid, "registry"))
    return procs


@dataclass
class Window:
    results: dict[str, list[Result]] = field(default_factory=lambda: {"stream": [], "whole": []})


def target(port: int, stream: bool, max_tokens: int) -> HttpTarget:
    if stream:
        body = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                "stream": True}
        return HttpTarget("127.0.0.1", port, "/v1/chat/completions", json.dumps(body).encode(), True, max_tokens)
    body = {"model": "sim", "prompt": PROMPT, "max_tokens": max_tokens}
    return HttpTarget("127.0.0.1", port, "/v1/completions", json.dumps(body).encode(), False, max_tokens)


async def load(port: int, args: argparse.Namespace, windows: list[Window], stop_at: float) -> None:
    kinds = {"stream": target(port, True, args.max_tokens), "whole": target(port, False, args.max_tokens)}
    half = max(1, args.concurrency // 2)

    async def users(kind: str) -> None:
        while time.monotonic() < stop_at:
            batch = await closed_loop(kinds[kind], half * args.reconnect_every, half, stagger_s=0.05)
            windows[-1].results[kind].extend(batch)

    await asyncio.gather(users("stream"), users("whole"))


def fmt_ms(values: list[float], q: float) -> str:
    value = percentile(values, q)
    return f"{value * 1000:7.1f}" if value == value else "      -"


def report(index: int, window: Window, procs: list[Proc], rss: dict[int, list[float]], elapsed_s: float) -> None:
    stream, whole = window.results["stream"], window.results["whole"]
    errors = [r.error for r in stream + whole if r.error]
    ttft = [r.ttft_s for r in stream if r.ttft_s is not None and not r.error]
    ok_whole = [r.latency_s for r in whole if not r.error]
    ok_stream = [r.latency_s for r in stream if not r.error]
    done = len(stream) + len(whole)
    row = (f"{index:>3} {done:>7} {len(errors):>5} {done / elapsed_s:>7.1f} "
           f"{fmt_ms(ok_whole, 50)} {fmt_ms(ok_whole, 99)} {fmt_ms(ok_stream, 50)} {fmt_ms(ok_stream, 99)} "
           f"{fmt_ms(ttft, 50)} {fmt_ms(ttft, 99)} | " + " ".join(f"{rss[p.pid][-1]:6.1f}" for p in procs))
    print(row, flush=True)
    if errors:
        print(f"    errors: {sorted(set(errors))[:3]}", flush=True)


def pools_full(procs: list[Proc], timeout_s: float = 30.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        leaks = []
        for p in procs:
            if p.http_port is None:
                continue
            try:
                load = get_json(f"http://127.0.0.1:{p.http_port}/load")
            except OSError as exc:  # (a worker that died: a verdict, not a traceback)
                leaks.append(f"{p.name}: its /load did not answer ({exc})")
                continue
            assert isinstance(load, dict)
            if load["num_free_pages"] != load["num_total_pages"]:
                leaks.append(f"{p.name}: {load['num_total_pages'] - load['num_free_pages']} pages held")
        if not leaks or time.monotonic() > deadline:
            return leaks
        time.sleep(0.5)


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--transfer", default="tcp")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--reconnect-every", type=int, default=8, help="requests per connection before a new one")
    ap.add_argument("--model-cost", action="store_true", help="keep the sim engine's latency model (default: 0)")
    ap.add_argument("--rss-slack-pct", type=float, default=10.0)
    ap.add_argument("--rss-slack-mib", type=float, default=20.0)
    args = ap.parse_args()

    port = free_port()
    argv = [sys.executable, "-m", "gateway.cluster", "--engine", "sim", "--prefill", str(args.prefill),
            "--decode", str(args.decode), "--transfer", args.transfer, "--port", str(port), "--page-size", "4",
            "--num-pages", "4096"]
    if not args.model_cost:
        argv += [f"--engine-option={k}=0" for k in ("prefill_token_s", "decode_step_s", "decode_seq_s")]
    cluster = subprocess.Popen(argv, cwd=REPO, start_new_session=True, stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                ready = get_json(f"http://127.0.0.1:{port}/readiness")
                if isinstance(ready, dict) and ready.get("ready"):
                    break
            except OSError:
                pass
            if cluster.poll() is not None or time.monotonic() > deadline:
                sys.exit("soak: the cluster did not come up")
            time.sleep(0.5)
        procs = cluster_procs(cluster.pid)
        rss: dict[int, list[float]] = {p.pid: [rss_mib(p.pid)] for p in procs}
        print(f"soak: {args.minutes:g} min, {args.concurrency} users (half streaming), {args.prefill}P+{args.decode}D "
              f"{args.transfer}, {args.max_tokens} tokens per request", flush=True)
        print("win    reqs  errs   req/s  whole p50   p99 stream p50   p99  ttft p50   p99 | RSS MiB: "
              + " ".join(p.name for p in procs), flush=True)
        stop_at = time.monotonic() + args.minutes * 60
        windows = [Window()]

        async def run() -> None:
            task = asyncio.create_task(load(port, args, windows, stop_at))
            start = time.monotonic()
            while not task.done():
                await asyncio.wait({task}, timeout=args.window_s)
                now = time.monotonic()
                for p in procs:
                    rss[p.pid].append(rss_mib(p.pid))
                report(len(windows), windows[-1], procs, rss, now - start)
                start = now
                windows.append(Window())
            await task

        asyncio.run(run())
        leaks = pools_full(procs)
        failures = sum(1 for w in windows for rs in w.results.values() for r in rs if r.error)
        total = sum(len(rs) for w in windows for rs in w.results.values())
        print(f"\nrequests {total}, failed {failures}; RSS MiB after the first window -> at the end:")
        grew, exited = [], []
        for p in procs:
            first, last = rss[p.pid][1] if len(rss[p.pid]) > 1 else rss[p.pid][0], rss[p.pid][-1]
            slack = max(first * args.rss_slack_pct / 100, args.rss_slack_mib)
            # A process whose RSS can no longer be read has exited (the OOM killer, a crash; pd-cluster then
            # restarts it under a new pid, which this run does not follow): a failure, not "ok" (NaN > slack
            # is False).
            flag = "EXITED" if any(math.isnan(v) for v in rss[p.pid]) else "GREW" if last - first > slack else "ok"
            print(f"  {p.name:<22} {rss[p.pid][0]:7.1f} (start) {first:7.1f} -> {last:7.1f}  {flag}")
            if flag == "GREW":
                grew.append(p.name)
            elif flag == "EXITED":
                exited.append(p.name)
        print(f"KV pages held once idle: {leaks or 'none'}")
        ok = not grew and not exited and not failures and not leaks
        print("VERDICT:", "PASS" if ok else
              f"FAIL (grew: {grew}, exited: {exited}, failed: {failures}, leaks: {leaks})")
        sys.exit(0 if ok else 1)
    finally:
        if cluster.poll() is None:
            os.killpg(cluster.pid, signal.SIGTERM)
            try:
                cluster.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(cluster.pid, signal.SIGKILL)
                cluster.wait()


if __name__ == "__main__":
    main()
