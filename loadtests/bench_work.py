"""How much Python the gateway runs per request, against the floor, counted rather than timed.

CPU time on the development VM drifts by a factor of two within minutes (``docs/performance.md``),
more than most changes to the hot path; the bytecode a request executes does not. This benchmark
starts the floor (``floor_app.py``) and gateways over fast workers (``fast_worker.py``: 2 prefills,
2 decodes) under ``opcount.py``, runs each point's requests with counting on (the event loop's
thread; C code such as uvloop, httptools, msgspec and the kernel is not counted), and prints per point
the opcodes and Python calls per request, then the gateway's figures against the floor's:

- ``ns``: chat, 16 tokens, 64 concurrent, non-streaming (the x-floor goal's point);
- ``stream``: chat, 64 tokens at a token gap (default 50 ms: counting slows a server some fifty times,
  and at 2 ms it would fall behind its streams), 64 concurrent, staggered over one stream's length;
  "per token above ns" = (stream - ns) / 64 as the µs/token goal figure is made;
- ``sglang`` (only when asked): chat, 16 tokens, 64 concurrent, non-streaming, through the SGLang relay
  (``gateway/sglang_relay.py``) to a sim prefill + decode's SGLang HTTP side at zero model cost (the
  workers' own Python is not counted); ``sglang-stream``: the same streamed, 64 tokens at the sim's own pace
  (one event per token), "per event above sglang" as the per-token figure is made.

An opcode is not a fixed cost (a call or an allocation costs more than a local load), so the figures
rank work and compare versions; the timed figures are ``bench_stack.py``'s and ``bench_ab.py``'s.

    .venv/bin/python loadtests/bench_work.py [--tree /tmp/base] [--top 25] [--requests 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import SIM_OPTIONS, Stack, http_target, wait_tcp  # noqa: E402
from load_client import closed_loop  # noqa: E402
from pdtest import Procs, free_port, start_bootstrap, start_worker, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402

OPCOUNT = str(REPO / "loadtests" / "opcount.py")
CHAT = "/v1/chat/completions"
Rows = list[tuple[int, int, str]]


def fast_fleet(stack: Stack, token_gap_ms: float, per_side: int = 2) -> tuple[list[str], list[str]]:
    """``per_side`` fast prefills, as many fast decodes and as many decodes with the token gap, started and
    listening: a gateway's worker arguments over the prefills with the fast decodes and with the gap decodes."""
    names = {role: [f"{role}-{i}" for i in range(per_side)] for role in ("prefill", "decode", "decode-gap")}
    for role, side in names.items():
        for name in side:
            stack.fast_worker(name, role.removesuffix("-gap"), token_gap_ms if role == "decode-gap" else 0)
    for name in (n for side in names.values() for n in side):
        wait_tcp(stack.ports[name], next(p for p in stack.procs.procs if p.pid == stack.pids[name]))

    def flags(flag: str, side: list[str]) -> list[str]:
        return [a for name in side for a in (flag, stack.url(name))]

    prefills = flags("--prefill", names["prefill"])
    return [*prefills, *flags("--decode", names["decode"])], [*prefills, *flags("--decode", names["decode-gap"])]


def start_counted(stack: Stack, name: str, out: Path, cwd: Path, *args: str) -> None:
    port = free_port()
    proc = stack.procs.start(name, OPCOUNT, str(out), *args, "--port", str(port), "--log-level", "warning",
                             cwd=cwd, env={"PYTHONPATH": str(cwd)})
    stack.pids[name], stack.ports[name] = proc.pid, port


async def count(stack: Stack, name: str, out: Path, stream: bool, tokens: int, requests: int,
                stagger_s: float) -> Rows:
    """``requests`` requests to ``name`` with counting on (after a warm-up with it off): its rows."""
    target = http_target(stack.ports[name], CHAT, tokens, stream)
    await closed_loop(target, 256, 64, stagger_s)
    out.unlink(missing_ok=True)
    os.kill(stack.pids[name], signal.SIGUSR1)
    await asyncio.sleep(0.2)  # (the handler runs at the server's next bytecode: an idle loop wakes for it)
    results = await closed_loop(target, requests, 64, stagger_s)
    os.kill(stack.pids[name], signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not out.exists():  # (moved into place once written whole)
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} wrote no counts")
        await asyncio.sleep(0.1)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
    return [(int(n), int(c), str(where)) for n, c, where in json.loads(out.read_text())]


def per_request(rows: Rows, requests: int) -> tuple[float, float]:
    return sum(r[0] for r in rows) / requests, sum(r[1] for r in rows) / requests


def print_top(title: str, rows: Rows, requests: int, top: int) -> None:
    print(f"\n{title}: opcodes per request by module, then the top {top} functions")
    by_module: dict[str, int] = {}
    for n, _, where in rows:
        module = where.split(":", 1)[0]
        by_module[module] = by_module.get(module, 0) + n
    print("  " + ", ".join(f"{Path(m).name} {v / requests:.0f}"
                           for m, v in sorted(by_module.items(), key=lambda kv: -kv[1])[:16]))
    for n, c, where in sorted(rows, reverse=True)[:top]:
        print(f"  {n / requests:8.1f} ops {c / requests:6.2f} calls  {where}")


async def run(args: argparse.Namespace, tmp: Path) -> None:
    tree = Path(args.tree).resolve()
    points = set(args.points.split(","))
    stack = Stack(Procs(tmp))
    outs = {name: tmp / f"{name}.json" for name in ("floor", "gw", "gw-stream", "gw-http")}
    try:
        start_counted(stack, "floor", outs["floor"], REPO, "loadtests/floor_app.py",
                      "--token-gap-ms", str(args.token_gap_ms))
        workers, gap_workers = fast_fleet(stack, args.token_gap_ms, args.workers)
        start_counted(stack, "gw", outs["gw"], tree, "-m", "gateway.cli", *workers)
        start_counted(stack, "gw-stream", outs["gw-stream"], tree, "-m", "gateway.cli", *gap_workers)
        gateways = ["gw", "gw-stream"]
        if points & {"sglang", "sglang-stream"}:  # sim workers, through their SGLang HTTP side
            boot = start_bootstrap(stack.procs)
            sims = {role: start_worker(stack.procs, role, *SIM_OPTIONS, bootstrap=boot, name=f"sim-{role}")
                    for role in ("prefill", "decode")}
            start_counted(stack, "gw-http", outs["gw-http"], tree, "-m", "gateway.cli",
                          "--prefill", f"http://127.0.0.1:{sims['prefill'].http_port}", boot.rsplit(":", 1)[1],
                          "--decode", f"http://127.0.0.1:{sims['decode'].http_port}")
            gateways.append("gw-http")
        by_pid = {p.pid: p for p in stack.procs.procs}
        wait_http_ok(f"http://127.0.0.1:{stack.ports['floor']}/", 60, by_pid[stack.pids["floor"]])
        for name in gateways:
            wait_http_ok(f"http://127.0.0.1:{stack.ports[name]}/readiness", 60, by_pid[stack.pids[name]])
        stagger = 64 * args.token_gap_ms / 1000
        n, s = args.requests, max(64, args.requests // 4)
        figures: dict[str, tuple[float, float]] = {}
        gw_rows: dict[str, Rows] = {}
        for key, name, stream, tokens, requests in (("floor ns", "floor", False, 16, n),
                                                    ("gateway ns", "gw", False, 16, n),
                                                    ("floor stream", "floor", True, 64, s),
                                                    ("gateway stream", "gw-stream", True, 64, s),
                                                    ("gateway sglang", "gw-http", False, 16, n),
                                                    ("gateway sglang-stream", "gw-http", True, 64, s)):
            if key.split()[1] not in points:
                continue
            rows = await count(stack, name, outs[name], stream, tokens, requests,
                               stagger if stream and name != "gw-http" else 0.0)
            figures[key] = per_request(rows, requests)
            if name.startswith("gw"):
                gw_rows[key] = rows
            ops, calls = figures[key]
            print(f"{key:22} {ops:9.0f} opcodes/request {calls:7.1f} Python calls/request  ({requests} requests)",
                  flush=True)
    finally:
        stack.procs.stop_all()
    print(f"\ngateway tree: {tree}")
    if "ns" in points:
        f_ns, g_ns = figures["floor ns"][0], figures["gateway ns"][0]
        print(f"ns: gateway / floor = {g_ns / f_ns:.2f} ({g_ns:.0f} / {f_ns:.0f} opcodes per request)")
        if "stream" in points:
            f_tok = (figures["floor stream"][0] - f_ns) / 64
            g_tok = (figures["gateway stream"][0] - g_ns) / 64
            print(f"stream, per token above ns: gateway {g_tok:.1f}, floor {f_tok:.1f} opcodes")
    if {"sglang", "sglang-stream"} <= points:
        per_event = (figures["gateway sglang-stream"][0] - figures["gateway sglang"][0]) / 64
        print(f"sglang-stream, per event above sglang: {per_event:.1f} opcodes")
    if args.top:
        for key, rows in gw_rows.items():
            print_top(key, rows, s if key.endswith("stream") else n, args.top)


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(REPO), help="the gateway's checkout to count (default: this one)")
    ap.add_argument("--requests", type=int, default=1000, help="non-streaming requests per point (streams: 1/4)")
    ap.add_argument("--token-gap-ms", type=float, default=50.0)
    ap.add_argument("--points", default="ns,stream",
                    help="ns, stream, sglang, sglang-stream, comma-separated (the per-token figures need both "
                         "of their pair)")
    ap.add_argument("--workers", type=int, default=2, help="fast prefills and fast decodes behind the gateway, each")
    ap.add_argument("--top", type=int, default=0, help="also list the gateway's top N functions per point")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-work-") as tmp:
        uvloop.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
