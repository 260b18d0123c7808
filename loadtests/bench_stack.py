"""Stack benchmark: the gateway's own cost against the Python floor, and the whole PD stack at zero model cost.

It starts everything it measures (real processes, reaped in ``finally``), pins the gateway to core 0
and itself (the client) and every worker to core 1, and per point prints requests/s, latency
p50/p99, for streams TTFT and inter-token latency p50/p99, and CPU-µs per request of every process
taking part (from ``/proc/<pid>/task/*/schedstat``, ns resolution; ``/proc/<pid>/stat`` ticks when a
thread ended during the point).

Sections (``--quick``: about a fifth of the requests):
1. ``fast``: the Python floor (``floor_app.py``: a raw ASGI app under the gateway's uvicorn
   settings) and the gateway over trivially fast workers (``fast_worker.py``), 2 prefill + 2 decode
   and 1 combined: chat non-streaming 16 tokens at 64 concurrent, streaming 64 tokens with a 2 ms
   token gap at 64 concurrent, non-streaming one at a time, ``/generate`` at 64 concurrent, an open
   loop at half the closed loop's rate; and the fast workers driven directly over the native protocol
   (the TTFT and latency baselines). Non-streaming points use workers that send all tokens at once,
   streaming points workers with the token gap.
2. ``sim``: real bootstrap + sim prefill/decode/combined workers at zero model cost (``verify_kv=0``),
   one request at a time, 16 tokens, PD vs combined, through the gateway and driven directly; and
   PD at 64 concurrent.

Derived figures (issue 10): the gateway's CPU per request over the floor's; "µs per token above
non-streaming" = (gateway CPU/request streaming 64 tokens - non-streaming 16 tokens) / 64; "TTFT
added by the gateway" = client TTFT through the gateway (request sent -> first SSE event with text)
minus TTFT straight against the same fast decode workers (``Submit`` -> first ``StepOutput`` with a
token, same concurrency and token gap), at p50 and at p99; also printed: the client's TTFT through the
gateway minus its TTFT from the floor's stream (the same HTTP client, so without the client's own cost).

With ``--rounds N`` the points the gateway goal figures come from (``ROUND_KEYS``) run N times,
interleaved, and each round's own ratios and differences are printed with their medians: on a
shared virtual machine whose speed drifts within minutes, a ratio of two points measured in the
same round is steadier than one of points measured a whole run apart. The sim section's one-at-a-time
points (PD and combined, ``SIM_ROUND_KEYS``) run N times too, interleaved, each round's PD p50, combined p50
and their difference printed with the medians. ``wakeup_probe.py``'s
loopback round trips (same core, across cores) are printed before and after the run: every latency
through the gateway crosses cores four times.

    .venv/bin/python loadtests/bench_stack.py [--quick] [--rounds N] [--json OUT] [--sections fast,sim]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from load_client import HttpTarget, NativeTarget, Result, closed_loop, open_loop, percentile  # noqa: E402
from pdtest import Procs, free_port, start_bootstrap, start_worker, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402
from wakeup_probe import describe  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROMPT = "Benchmark prompt: the gateway's own cost per request, measured in CPU time. " * 2
SIM_OPTIONS = ("--engine", "sim", "--num-pages", "1024", "--engine-option", "prefill_token_s=0",
               "--engine-option", "decode_step_s=0", "--engine-option", "decode_seq_s=0",
               "--engine-option", "verify_kv=0")
CAVEAT = ("machine: 2 cores shared by everything: gateway (or floor) pinned to core 0; client, workers, "
          "registry on core 1. Compare rows of one run, not runs or machines.")


# -- processes ----------------------------------------------------------------------------------------
def pin(pid: int, cpus: set[int]) -> None:
    """Every thread of ``pid`` (threads made later inherit it from theirs)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, OSError):
            pass


def cpu_sample(pid: int) -> tuple[int, int]:
    """(ns on CPU summed over the live threads, utime+stime ticks of the whole process)."""
    ns = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            ns += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return ns, int(fields[11]) + int(fields[12])


def machine_busy_s() -> float:
    """CPU time all cores spent busy since boot (``/proc/stat``: everything but idle and iowait)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(values[:8]) - values[3] - values[4]) / CLK_TCK


def cpu_delta_s(before: tuple[int, int], after: tuple[int, int]) -> float:
    by_ns, by_ticks = (after[0] - before[0]) / 1e9, (after[1] - before[1]) / CLK_TCK
    return by_ticks if by_ticks - by_ns > 2 / CLK_TCK else by_ns  # a thread that ended took its ns along


def wait_tcp(port: int, proc: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} while starting on port {port}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listening on port {port} after {timeout_s}s")


@dataclass
class Stack:
    """The processes of one section, by name; ``pid`` and ``url`` for the points."""

    procs: Procs
    pids: dict[str, int] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)  # started, not yet waited for

    def fast_worker(self, name: str, role: str, gap_ms: float) -> None:
        port = free_port()
        proc = self.procs.start(name, "loadtests/fast_worker.py", "--role", role, "--port", str(port),
                                "--token-gap-ms", str(gap_ms))
        self.pids[name], self.ports[name] = proc.pid, port
        self.pending.append(name)

    def http(self, name: str, *args: str) -> None:
        port = free_port()
        proc = self.procs.start(name, *args, "--port", str(port), "--log-level", "warning")
        self.pids[name], self.ports[name] = proc.pid, port
        self.pending.append(name)

    def gateway(self, name: str, *workers: tuple[str, str]) -> None:
        args = [a for flag, w in workers for a in (f"--{flag}", self.url(w))]
        self.http(name, "-m", "gateway.cli", *args)

    def url(self, name: str) -> str:
        return f"pd://127.0.0.1:{self.ports[name]}"

    def sglang_router(self, name: str, site: Path, prefill_http: int, bootstrap_port: int, decode_http: int) -> None:
        """SGLang's Rust router in PD mode in front of our workers' SGLang HTTP side."""
        port = free_port()
        proc = self.procs.start(name, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                                "--prefill", f"http://127.0.0.1:{prefill_http}", str(bootstrap_port),
                                "--decode", f"http://127.0.0.1:{decode_http}", "--host", "127.0.0.1",
                                "--port", str(port), "--policy", "round_robin", "--log-level", "warn",
                                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                env={"PYTHONPATH": str(site), "HF_HUB_OFFLINE": "1"})
        self.pids[name], self.ports[name] = proc.pid, port
        self.pending.append(name)

    def wait(self) -> None:
        by_pid = {p.pid: p for p in self.procs.procs}
        names, self.pending = self.pending, []
        for name in names:
            port, proc = self.ports[name], by_pid[self.pids[name]]
            try:
                if name.startswith("gw"):
                    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)
                elif name.startswith("rust"):
                    wait_http_ok(f"http://127.0.0.1:{port}/health", 60, proc)
                    wait_generate_ok(port, proc)
                elif name == "floor":
                    wait_http_ok(f"http://127.0.0.1:{port}/", 30, proc)
                else:
                    wait_tcp(port, proc)
            except Exception as exc:
                raise RuntimeError(f"{name} did not start: {exc}\n{self.procs.log(name)[-2000:]}") from exc

    def pin(self) -> None:
        """Gateways, routers and the floor on core 0; everything else this stack started on core 1."""
        for proc in self.procs.procs:
            name = next((k for k, v in self.pids.items() if v == proc.pid), "")
            pin(proc.pid, {0} if name.startswith(("gw", "rust")) or name == "floor" else {1})


def wait_generate_ok(port: int, proc: Any, timeout_s: float = 30.0) -> None:
    """The Rust router answers /health before its first worker checks passed: wait for a real answer."""
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    data = json.dumps({"text": "warm", "sampling_params": {"max_new_tokens": 1}}).encode()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode}")
        try:
            request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=data,
                                             headers={"content-type": "application/json"})
            with urllib.request.urlopen(request, timeout=10) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"router on port {port} did not answer /generate")
        time.sleep(0.2)


def sglang_router_site() -> Path | None:
    """Where ``make install`` put SGLang's router (``.venv/sglang-router``), if it did."""
    site = Path(sys.prefix) / "sglang-router"
    return site if (site / "sglang_router").is_dir() else None


# -- points -----------------------------------------------------------------------------------------
@dataclass
class Point:
    key: str
    title: str
    target: HttpTarget | NativeTarget
    procs: dict[str, int]  # name -> pid whose CPU counts
    num_requests: int
    concurrency: int = 1
    rate_per_s: float | None = None  # open loop
    stagger_s: float = 0.0  # closed loop: first requests spread over this long (see ``closed_loop``)
    figures: dict[str, Any] = field(default_factory=dict)


def body(route: str, max_tokens: int, stream: bool) -> bytes:
    if route == "/generate":
        payload: dict[str, Any] = {"text": PROMPT, "sampling_params": {"max_new_tokens": max_tokens},
                                   "stream": stream}
    else:
        payload = {"model": "sim", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                   "stream": stream}
    return json.dumps(payload).encode()


def http_target(port: int, route: str, max_tokens: int, stream: bool) -> HttpTarget:
    return HttpTarget("127.0.0.1", port, route, body(route, max_tokens, stream), stream, max_tokens)


async def run_point(point: Point, warm: int) -> None:
    target = point.target
    if isinstance(target, NativeTarget):
        await target.open()
    try:
        if warm:
            await closed_loop(target, warm, point.concurrency)
        pids = {**point.procs, "client": os.getpid()}
        before = {name: cpu_sample(pid) for name, pid in pids.items()}
        busy_before = machine_busy_s()
        started = time.perf_counter()
        peak = point.concurrency
        if point.rate_per_s is not None:
            assert isinstance(target, HttpTarget)
            results, peak = await open_loop(target, point.num_requests, point.rate_per_s)
        else:
            results = await closed_loop(target, point.num_requests, point.concurrency, point.stagger_s)
        wall_s = time.perf_counter() - started
        busy_s = machine_busy_s() - busy_before
        after = {name: cpu_sample(pid) for name, pid in pids.items()}
    finally:
        if isinstance(target, NativeTarget):
            await target.aclose()
    point.figures = summarize(results, wall_s, peak)
    cpu_s = {name: cpu_delta_s(before[name], after[name]) for name in pids}
    point.figures["cpu_us_per_req"] = {name: v / max(1, len(results)) * 1e6 for name, v in cpu_s.items()}
    # Whatever else ran meanwhile (idle stack processes, other users of the machine), in cores.
    point.figures["other_cpu_cores"] = max(0.0, busy_s - sum(cpu_s.values())) / wall_s
    print_point(point)


def summarize(results: list[Result], wall_s: float, peak: int) -> dict[str, Any]:
    ok = [r for r in results if r.error is None]
    errors = [r.error for r in results if r.error is not None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [gap for r in ok for gap in r.itl_s]
    num_events = sum(len(r.itl_s) + 1 for r in ok if r.ttft_s is not None)
    ms = 1e3
    return {
        "requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
        "wall_s": wall_s, "req_per_s": len(results) / wall_s, "peak_in_flight": peak,
        "latency_ms_p50": percentile([r.latency_s for r in ok], 50) * ms,
        "latency_ms_p99": percentile([r.latency_s for r in ok], 99) * ms,
        "ttft_ms_p50": percentile(ttft, 50) * ms if ttft else None,
        "ttft_ms_p99": percentile(ttft, 99) * ms if ttft else None,
        "itl_ms_p50": percentile(itl, 50) * ms if itl else None,
        "itl_ms_p99": percentile(itl, 99) * ms if itl else None,
        "tokens_per_event": sum(r.num_tokens for r in ok if r.ttft_s is not None) / num_events if num_events else None,
    }


def fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:,.{digits}f}"


def print_point(point: Point) -> None:
    f = point.figures
    load = f"open loop {point.rate_per_s:,.0f}/s (peak {f['peak_in_flight']} in flight)" if point.rate_per_s \
        else f"closed loop c={point.concurrency}" + (f", starts staggered over {point.stagger_s * 1e3:.0f} ms"
                                                     if point.stagger_s else "")
    print(f"\n[{point.key}] {point.title} · {load}")
    print(f"  {'requests':>9} {'errors':>6} {'req/s':>9} {'lat p50':>9} {'lat p99':>9} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    print(f"  {f['requests']:>9} {f['errors']:>6} {f['req_per_s']:>9,.0f} {fmt(f['latency_ms_p50']):>9} "
          f"{fmt(f['latency_ms_p99']):>9} {fmt(f['ttft_ms_p50'], 3):>9} {fmt(f['ttft_ms_p99'], 3):>9} "
          f"{fmt(f['itl_ms_p50']):>8} {fmt(f['itl_ms_p99']):>8}")
    cpu = "  ".join(f"{name} {us:,.1f}" for name, us in f["cpu_us_per_req"].items())
    print(f"  CPU µs/request: {cpu}   (anything else on the machine: {f['other_cpu_cores']:.2f} cores)")
    if f["tokens_per_event"] is not None:
        print(f"  tokens per streamed event: {f['tokens_per_event']:.2f}")
    if f["errors"]:
        print(f"  !! {f['errors']} errors, first: {f['first_error']}")


# -- sections ---------------------------------------------------------------------------------------
# The points the issue-10 gateway figures come from: with ``--rounds N`` they run N times, interleaved,
# so that each round's ratios compare points measured minutes apart at most, not a whole run apart.
ROUND_KEYS = ("floor.c64", "floor.stream", "pd.c64", "pd.stream", "both.c64", "both.stream",
              "native.decode.stream", "native.both.stream")


async def fast_section(stack: Stack, scale: float, gap_ms: float,
                       rounds: int = 1) -> tuple[list[Point], list[dict[str, Point]]]:
    """Every fast point once, then ``rounds - 1`` more rounds of ``ROUND_KEYS`` (returned by round)."""
    p, pid = stack.ports, stack.pids
    spread = 64 * gap_ms / 1000  # one stream's length: streams start out of phase, as they would in service
    n = lambda base: max(64, int(base * scale))  # noqa: E731
    ids = list(PROMPT.encode())
    pd_ns = {k: pid[k] for k in ("gw-pd", "prefill-0", "prefill-1", "decode-0", "decode-1")}
    pd_st = {k: pid[k] for k in ("gw-pd-stream", "prefill-0", "prefill-1", "decode-gap-0", "decode-gap-1")}
    both_ns, both_st = {k: pid[k] for k in ("gw-both", "both")}, {k: pid[k] for k in ("gw-both-stream", "both-gap")}
    chat = "/v1/chat/completions"
    points = [
        Point("floor.c64", "floor (raw ASGI) · chat non-stream 16 tokens", http_target(p["floor"], chat, 16, False),
              {"floor": pid["floor"]}, n(8000), 64),
        Point("floor.stream", f"floor · chat stream 64 tokens, {gap_ms:g} ms gap",
              http_target(p["floor"], chat, 64, True), {"floor": pid["floor"]}, n(1500), 64, stagger_s=spread),
        Point("floor.c1", "floor · chat non-stream 16 tokens", http_target(p["floor"], chat, 16, False),
              {"floor": pid["floor"]}, n(2000), 1),
        Point("pd.c64", "gateway -> 2 prefill + 2 decode fast · chat non-stream 16 tokens",
              http_target(p["gw-pd"], chat, 16, False), pd_ns, n(8000), 64),
        Point("pd.stream", f"gateway -> 2 prefill + 2 decode fast ({gap_ms:g} ms gap) · chat stream 64 tokens",
              http_target(p["gw-pd-stream"], chat, 64, True), pd_st, n(1500), 64, stagger_s=spread),
        Point("pd.stream.burst", "the same, all 64 streams in phase (64 arrivals at once every 64 ticks)",
              http_target(p["gw-pd-stream"], chat, 64, True), pd_st, n(1500), 64),
        Point("pd.c1", "gateway -> 2 prefill + 2 decode fast · chat non-stream 16 tokens",
              http_target(p["gw-pd"], chat, 16, False), pd_ns, n(2000), 1),
        Point("pd.generate.c64", "gateway -> 2 prefill + 2 decode fast · /generate non-stream 16 tokens",
              http_target(p["gw-pd"], "/generate", 16, False), pd_ns, n(4000), 64),
        Point("both.c64", "gateway -> 1 combined fast · chat non-stream 16 tokens",
              http_target(p["gw-both"], chat, 16, False), both_ns, n(8000), 64),
        Point("both.stream", f"gateway -> 1 combined fast ({gap_ms:g} ms gap) · chat stream 64 tokens",
              http_target(p["gw-both-stream"], chat, 64, True), both_st, n(1500), 64, stagger_s=spread),
        Point("both.c1", "gateway -> 1 combined fast · chat non-stream 16 tokens",
              http_target(p["gw-both"], chat, 16, False), both_ns, n(2000), 1),
        Point("native.decode.stream",
              f"native -> 2 fast decode ({gap_ms:g} ms gap, round robin), no gateway · 64 tokens",
              NativeTarget([stack.url("decode-gap-0"), stack.url("decode-gap-1")], ids, 64, role="decode"),
              {k: pid[k] for k in ("decode-gap-0", "decode-gap-1")}, n(1500), 64, stagger_s=spread),
        Point("native.decode.stream.burst", "the same, all 64 streams in phase",
              NativeTarget([stack.url("decode-gap-0"), stack.url("decode-gap-1")], ids, 64, role="decode"),
              {k: pid[k] for k in ("decode-gap-0", "decode-gap-1")}, n(1500), 64),
        Point("native.both.stream", f"native -> 1 combined fast ({gap_ms:g} ms gap), no gateway · 64 tokens",
              NativeTarget([stack.url("both-gap")], ids, 64), {"both-gap": pid["both-gap"]}, n(1500), 64,
              stagger_s=spread),
        Point("native.pd.c1", "native -> fast prefill + decode, no gateway · 16 tokens",
              NativeTarget([stack.url("decode-0")], ids, 16, stack.url("prefill-0")),
              {k: pid[k] for k in ("prefill-0", "decode-0")}, n(2000), 1),
        Point("native.both.c1", "native -> 1 combined fast, no gateway · 16 tokens",
              NativeTarget([stack.url("both")], ids, 16), {"both": pid["both"]}, n(2000), 1),
    ]
    done = []
    for point in points:
        await run_point(point, warm=2 * point.concurrency if point.concurrency > 1 else 50)
        done.append(point)
        if point.key == "pd.c64":  # open loop at half of what the closed loop reached
            rate = point.figures["req_per_s"] / 2
            open_point = Point("pd.open", "gateway -> 2 prefill + 2 decode fast · chat non-stream 16 tokens",
                               http_target(p["gw-pd"], chat, 16, False), pd_ns, max(64, int(rate * 3 * scale)),
                               64, rate_per_s=rate)
            await run_point(open_point, warm=128)
            done.append(open_point)
    return done, await repeat_rounds(points, ROUND_KEYS, rounds, "round", lambda point: 2 * point.concurrency)


async def repeat_rounds(points: list[Point], keys: tuple[str, ...], rounds: int, label: str,
                      warm: Callable[[Point], int]) -> list[dict[str, Point]]:
    """Rounds 2 to ``rounds`` of the points named in ``keys``, each a fresh run of them in order (by round)."""
    more: list[dict[str, Point]] = []
    for number in range(2, rounds + 1):
        print(f"\n== {label} {number} of {rounds}: {', '.join(keys)} ==")
        again: dict[str, Point] = {}
        for point in (p for p in points if p.key in keys):
            repeat = dataclasses.replace(point, figures={})
            await run_point(repeat, warm=warm(repeat))
            again[repeat.key] = repeat
        more.append(again)
    return more


# The whole-stack goal's points: with ``--rounds N`` they run N times, interleaved (PD, combined, PD, ...).
SIM_ROUND_KEYS = ("sim.pd.c1", "sim.both.c1")


async def sim_section(stack: Stack, scale: float, rounds: int = 1) -> tuple[list[Point], list[dict[str, Point]]]:
    """Every sim point once, then ``rounds - 1`` more rounds of ``SIM_ROUND_KEYS`` (returned by round)."""
    p, pid = stack.ports, stack.pids
    n = lambda base: max(20, int(base * scale))  # noqa: E731
    ids = list(PROMPT.encode())
    chat = "/v1/chat/completions"
    pd = {k: pid[k] for k in ("gw-sim-pd", "sim-prefill", "sim-decode")}
    points = [
        Point("sim.pd.c1", "gateway -> sim prefill + decode (zero cost) · chat non-stream 16 tokens",
              http_target(p["gw-sim-pd"], chat, 16, False), pd, n(300)),
        Point("sim.both.c1", "gateway -> sim combined (zero cost) · chat non-stream 16 tokens",
              http_target(p["gw-sim-both"], chat, 16, False), {k: pid[k] for k in ("gw-sim-both", "sim-both")}, n(300)),
        Point("sim.native.pd.c1", "native -> sim prefill + decode, no gateway · 16 tokens",
              NativeTarget([stack.url("sim-decode")], ids, 16, stack.url("sim-prefill")),
              {k: pid[k] for k in ("sim-prefill", "sim-decode")}, n(300)),
        Point("sim.native.both.c1", "native -> sim combined, no gateway · 16 tokens",
              NativeTarget([stack.url("sim-both")], ids, 16), {"sim-both": pid["sim-both"]}, n(300)),
        Point("sim.pd.c64", "gateway -> sim prefill + decode (zero cost) · chat non-stream 16 tokens",
              http_target(p["gw-sim-pd"], chat, 16, False), pd, max(128, int(640 * scale)), 64),
    ]
    # The same workers over SGLang's HTTP PD protocol: our gateway's HTTP path, and SGLang's Rust router.
    for name, title in (("gw-sim-http", "gateway -(SGLang HTTP)->"), ("rust-sim", "SGLang Rust router ->")):
        if name not in p:
            continue
        procs_ = {k: pid[k] for k in (name, "sim-prefill", "sim-decode")}
        points += [
            Point(f"sim.{name}.c1", f"{title} sim prefill + decode · chat non-stream 16 tokens",
                  http_target(p[name], chat, 16, False), procs_, n(300)),
            Point(f"sim.{name}.c64", f"{title} sim prefill + decode · chat non-stream 16 tokens",
                  http_target(p[name], chat, 16, False), procs_, max(128, int(640 * scale)), 64),
        ]
    for point in points:
        await run_point(point, warm=2 * point.concurrency if point.concurrency > 1 else 20)
    return points, await repeat_rounds(points, SIM_ROUND_KEYS, rounds, "sim round", lambda point: 20)


def derived(points: dict[str, Point]) -> dict[str, Any]:
    """The issue-10 figures from one run (None where a point is missing)."""
    def cpu(key: str, proc: str) -> float | None:
        point = points.get(key)
        return point.figures["cpu_us_per_req"].get(proc) if point else None

    def fig(key: str, name: str) -> float | None:
        point = points.get(key)
        return point.figures.get(name) if point else None

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    out: dict[str, Any] = {}
    floor = cpu("floor.c64", "floor")
    for topo, gw in (("pd", "gw-pd"), ("both", "gw-both")):
        ns, st = cpu(f"{topo}.c64", gw), cpu(f"{topo}.stream", f"{gw}-stream")
        native = "native.decode.stream" if topo == "pd" else "native.both.stream"
        out[topo] = {
            "gateway_cpu_us_per_req_nonstream_c64": ns,
            "over_floor": ns / floor if ns is not None and floor else None,
            "gateway_cpu_us_per_req_stream64_c64": st,
            "us_per_token_above_nonstream": (st - ns) / 64 if st is not None and ns is not None else None,
            "gateway_cpu_us_per_req_c1": cpu(f"{topo}.c1", gw),
            "ttft_added_ms_p50": diff(fig(f"{topo}.stream", "ttft_ms_p50"), fig(native, "ttft_ms_p50")),
            "ttft_added_ms_p99": diff(fig(f"{topo}.stream", "ttft_ms_p99"), fig(native, "ttft_ms_p99")),
            # The same, against the floor's stream (the same HTTP client): without the client's own cost.
            "ttft_over_floor_ms_p50": diff(fig(f"{topo}.stream", "ttft_ms_p50"), fig("floor.stream", "ttft_ms_p50")),
            "ttft_over_floor_ms_p99": diff(fig(f"{topo}.stream", "ttft_ms_p99"), fig("floor.stream", "ttft_ms_p99")),
        }
    out["floor_cpu_us_per_req_nonstream_c64"] = floor
    floor_st = cpu("floor.stream", "floor")
    # What uvicorn itself costs per SSE chunk: the part of the gateway's per-token figure no gateway avoids.
    out["floor_us_per_token_above_nonstream"] = (floor_st - floor) / 64 if floor_st is not None and floor else None
    out["floor_ttft_ms_p50"], out["floor_ttft_ms_p99"] = fig("floor.stream", "ttft_ms_p50"), fig("floor.stream",
                                                                                              "ttft_ms_p99")
    out["sim"] = {
        "pd_p50_ms": fig("sim.pd.c1", "latency_ms_p50"), "both_p50_ms": fig("sim.both.c1", "latency_ms_p50"),
        "pd_above_both_p50_ms": diff(fig("sim.pd.c1", "latency_ms_p50"), fig("sim.both.c1", "latency_ms_p50")),
    }
    # Router CPU per request in front of the same sim workers: native protocol, SGLang HTTP, Rust router.
    out["router_cpu_us_per_req"] = {
        f"{label}.{conc}": cpu(f"{key}.{conc}", proc)
        for label, key, proc in (("gateway_native", "sim.pd", "gw-sim-pd"),
                                 ("gateway_sglang_http", "sim.gw-sim-http", "gw-sim-http"),
                                 ("sglang_rust_router", "sim.rust-sim", "rust-sim"))
        for conc in ("c1", "c64")
    }
    return out


def print_derived(d: dict[str, Any]) -> None:
    print("\n== issue 10 figures (this run) ==")
    print(f"floor: CPU µs/request (chat non-stream, c64) {fmt(d['floor_cpu_us_per_req_nonstream_c64'], 1)}; "
          f"µs/token above non-streaming {fmt(d['floor_us_per_token_above_nonstream'])}; "
          f"TTFT p50 {fmt(d['floor_ttft_ms_p50'], 3)} ms, p99 {fmt(d['floor_ttft_ms_p99'], 3)} ms")
    print(f"{'':6} {'gw µs/req':>10} {'x floor':>8} {'gw µs/req':>10} {'µs/token':>9} {'gw µs/req':>10} "
          f"{'TTFT added':>11} {'TTFT added':>11}")
    print(f"{'':6} {'c64':>10} {'(<=1.6)':>8} {'stream c64':>10} {'(<=10)':>9} {'c1':>10} "
          f"{'p50 ms':>11} {'p99 ms(<1)':>11}")
    for topo in ("pd", "both"):
        t = d[topo]
        print(f"{topo:6} {fmt(t['gateway_cpu_us_per_req_nonstream_c64'], 1):>10} {fmt(t['over_floor']):>8} "
              f"{fmt(t['gateway_cpu_us_per_req_stream64_c64'], 1):>10} {fmt(t['us_per_token_above_nonstream']):>9} "
              f"{fmt(t['gateway_cpu_us_per_req_c1'], 1):>10} {fmt(t['ttft_added_ms_p50'], 3):>11} "
              f"{fmt(t['ttft_added_ms_p99'], 3):>11}")
    print("TTFT through the gateway minus the floor's (the same HTTP client), p50 / p99 ms: " + "; ".join(
        f"{topo} {fmt(d[topo]['ttft_over_floor_ms_p50'], 3)} / {fmt(d[topo]['ttft_over_floor_ms_p99'], 3)}"
        for topo in ("pd", "both")))
    s = d["sim"]
    print(f"sim stack, one at a time, 16 tokens: PD p50 {fmt(s['pd_p50_ms'])} ms (<=3), combined p50 "
          f"{fmt(s['both_p50_ms'])} ms, PD above combined {fmt(s['pd_above_both_p50_ms'])} ms (<=1)")
    r = d["router_cpu_us_per_req"]
    print("router CPU µs/request in front of the same sim prefill + decode (chat 16 tokens; c1, c64): "
          + "; ".join(f"{label} {fmt(r[f'{label}.c1'], 0)}, {fmt(r[f'{label}.c64'], 0)}"
                      for label in ("gateway_native", "gateway_sglang_http", "sglang_rust_router")))


# -- main -------------------------------------------------------------------------------------------
async def run(args: argparse.Namespace,
              tmp: Path) -> tuple[list[Point], list[dict[str, Point]], list[dict[str, Point]]]:
    """Every point once, the fast section's extra rounds of ``ROUND_KEYS`` and the sim section's of
    ``SIM_ROUND_KEYS``."""
    scale = 0.2 if args.quick else 1.0
    more_rounds: list[dict[str, Point]] = []
    sim_rounds: list[dict[str, Point]] = []
    own_cpus = os.sched_getaffinity(0)
    can_pin = {0, 1} <= own_cpus
    if not can_pin:
        print("!! cores 0 and 1 not both available: nothing is pinned")
    points: list[Point] = []
    sections = set(args.sections.split(","))
    if "fast" in sections:
        stack = Stack(Procs(tmp))
        try:
            stack.http("floor", "loadtests/floor_app.py", "--token-gap-ms", str(args.token_gap_ms))
            for i in range(2):
                stack.fast_worker(f"prefill-{i}", "prefill", 0)
                stack.fast_worker(f"decode-{i}", "decode", 0)
                stack.fast_worker(f"decode-gap-{i}", "decode", args.token_gap_ms)
            stack.fast_worker("both", "both", 0)
            stack.fast_worker("both-gap", "both", args.token_gap_ms)
            stack.wait()
            stack.gateway("gw-pd", ("prefill", "prefill-0"), ("prefill", "prefill-1"), ("decode", "decode-0"),
                          ("decode", "decode-1"))
            stack.gateway("gw-pd-stream", ("prefill", "prefill-0"), ("prefill", "prefill-1"),
                          ("decode", "decode-gap-0"), ("decode", "decode-gap-1"))
            stack.gateway("gw-both", ("worker", "both"))
            stack.gateway("gw-both-stream", ("worker", "both-gap"))
            stack.wait()
            if can_pin:
                stack.pin()
                os.sched_setaffinity(0, {1})
            fast, more_rounds = await fast_section(stack, scale, args.token_gap_ms, args.rounds)
            points += fast
        finally:
            stack.procs.stop_all()
            os.sched_setaffinity(0, own_cpus)  # children started next must not inherit core 1 only
    if "sim" in sections:
        stack = Stack(Procs(tmp))
        try:
            boot = start_bootstrap(stack.procs)
            http_ports: dict[str, int] = {}
            for name, role, extra in (("sim-prefill", "prefill", boot), ("sim-decode", "decode", boot),
                                      ("sim-both", "both", None)):
                worker = start_worker(stack.procs, role, *SIM_OPTIONS, bootstrap=extra, name=name)
                stack.pids[name], stack.ports[name] = worker.proc.pid, worker.port
                http_ports[name] = worker.http_port
            stack.gateway("gw-sim-pd", ("prefill", "sim-prefill"), ("decode", "sim-decode"))
            stack.gateway("gw-sim-both", ("worker", "sim-both"))
            boot_port = int(boot.rsplit(":", 1)[1])
            stack.http("gw-sim-http", "-m", "gateway.cli", "--prefill", f"http://127.0.0.1:{http_ports['sim-prefill']}",
                       str(boot_port), "--decode", f"http://127.0.0.1:{http_ports['sim-decode']}")
            site = sglang_router_site()
            if site is not None:
                stack.sglang_router("rust-sim", site, http_ports["sim-prefill"], boot_port, http_ports["sim-decode"])
            else:
                print("!! SGLang's router is not installed (make install puts it in .venv/sglang-router): no rust rows")
            stack.wait()
            if can_pin:
                stack.pin()
                os.sched_setaffinity(0, {1})
            sim, sim_rounds = await sim_section(stack, scale, args.rounds)
            points += sim
        finally:
            stack.procs.stop_all()
            os.sched_setaffinity(0, own_cpus)
    return points, more_rounds, sim_rounds


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="about a fifth of the requests per point")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the goal points (ROUND_KEYS, SIM_ROUND_KEYS) this many times, interleaved; print "
                         "each round's ratios and differences and their medians")
    ap.add_argument("--sections", default="fast,sim", help="comma-separated: fast, sim")
    ap.add_argument("--token-gap-ms", type=float, default=2.0, help="streaming points: decode token gap")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write every figure to this JSON file")
    args = ap.parse_args()
    print(CAVEAT)
    wakeup = {"before": wakeup_figures()}
    print(f"machine, before: {describe_wakeup(wakeup['before'])}")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="bench-stack-") as tmp:
        points, more_rounds, sim_more = uvloop.run(run(args, Path(tmp)))
    wakeup["after"] = wakeup_figures()
    by_key = {p.key: p for p in points}
    d = derived(by_key)
    print_derived(d)
    rounds = [d] + [derived({**by_key, **again}) for again in more_rounds]
    medians = round_medians(rounds) if more_rounds else None
    if medians is not None:
        print_rounds(rounds, medians)
    sim_rounds = [d["sim"]] + [derived({**by_key, **again})["sim"] for again in sim_more]
    sim_medians = sim_round_medians(sim_rounds) if sim_more else None
    if sim_medians is not None:
        print_sim_rounds(sim_rounds, sim_medians)
    for when, figures in wakeup.items():
        print(f"machine, {when}: {describe_wakeup(figures)}")
    print(f"\n{CAVEAT}\ntotal {time.monotonic() - started:.0f} s")
    if args.json:
        report = {"caveat": CAVEAT, "quick": args.quick, "token_gap_ms": args.token_gap_ms, "wakeup": wakeup,
                  "rounds": [{topo: r[topo] for topo in ("pd", "both")} for r in rounds], "round_medians": medians,
                  "round_points": [{k: p.figures for k, p in again.items()} for again in more_rounds],
                  "sim_rounds": sim_rounds, "sim_round_medians": sim_medians,
                  "sim_round_points": [{k: p.figures for k, p in again.items()} for again in sim_more],
                  "points": [{"key": p.key, "title": p.title, "concurrency": p.concurrency,
                              "rate_per_s": p.rate_per_s, **p.figures} for p in points], "derived": d}
        Path(args.json).write_text(json.dumps(_finite(report), indent=2) + "\n")
        print(f"figures written to {args.json}")


ROUND_FIGURES = ("over_floor", "us_per_token_above_nonstream", "ttft_added_ms_p50", "ttft_added_ms_p99",
                 "ttft_over_floor_ms_p99")


def round_medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per topology, the median over rounds of each gateway goal figure (each round's own ratio or difference)."""
    out: dict[str, Any] = {}
    for topo in ("pd", "both"):
        out[topo] = {}
        for name in ROUND_FIGURES:
            values = [r[topo][name] for r in rounds if r[topo][name] is not None]
            out[topo][name] = statistics.median(values) if values else None
    floor = [r["floor_us_per_token_above_nonstream"] for r in rounds if r["floor_us_per_token_above_nonstream"]]
    out["floor_us_per_token_above_nonstream"] = statistics.median(floor) if floor else None
    return out


SIM_ROUND_FIGURES = ("pd_p50_ms", "both_p50_ms", "pd_above_both_p50_ms")


def sim_round_medians(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The median over rounds of each whole-stack figure (each round's own difference)."""
    out: dict[str, Any] = {}
    for name in SIM_ROUND_FIGURES:
        values = [r[name] for r in rounds if r[name] is not None]
        out[name] = statistics.median(values) if values else None
    return out


def print_sim_rounds(rounds: list[dict[str, Any]], medians: dict[str, Any]) -> None:
    print(f"\n== the whole-stack goal figures by round ({len(rounds)} rounds; sim at zero cost, one at a time) ==")
    print(f"{'':12} {'PD p50 ms':>10} {'combined':>10} {'PD above':>10}")
    print(f"{'':12} {'(<=3)':>10} {'p50 ms':>10} {'ms (<=1)':>10}")
    for i, r in enumerate(rounds):
        print(f"{f'round {i + 1}':12} {fmt(r['pd_p50_ms']):>10} {fmt(r['both_p50_ms']):>10} "
              f"{fmt(r['pd_above_both_p50_ms']):>10}")
    print(f"{'median':12} {fmt(medians['pd_p50_ms']):>10} {fmt(medians['both_p50_ms']):>10} "
          f"{fmt(medians['pd_above_both_p50_ms']):>10}")


def print_rounds(rounds: list[dict[str, Any]], medians: dict[str, Any]) -> None:
    print(f"\n== the gateway goal figures by round ({len(rounds)} rounds; each round's own ratios) ==")
    print(f"{'':12} {'x floor':>8} {'µs/token':>9} {'floor':>9} {'TTFT added':>11} {'TTFT added':>11} "
          f"{'TTFT-floor':>11}")
    print(f"{'':12} {'(<=1.6)':>8} {'(<=10)':>9} {'µs/token':>9} {'p50 ms':>11} {'p99 ms(<1)':>11} {'p99 ms':>11}")
    for topo in ("pd", "both"):
        rows = [(f"{topo} round {i + 1}", r[topo], r["floor_us_per_token_above_nonstream"])
                for i, r in enumerate(rounds)]
        rows.append((f"{topo} median", medians[topo], medians["floor_us_per_token_above_nonstream"]))
        for label, t, floor in rows:
            print(f"{label:12} {fmt(t['over_floor']):>8} {fmt(t['us_per_token_above_nonstream']):>9} {fmt(floor):>9} "
                  f"{fmt(t['ttft_added_ms_p50'], 3):>11} {fmt(t['ttft_added_ms_p99'], 3):>11} "
                  f"{fmt(t['ttft_over_floor_ms_p99'], 3):>11}")


def wakeup_figures() -> dict[str, Any]:
    """``wakeup_probe.py``'s round trips (its own process: it forks), or why there are none."""
    proc = subprocess.run([sys.executable, str(REPO / "loadtests" / "wakeup_probe.py"), "--json"],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip()[-500:]}
    figures: dict[str, Any] = json.loads(proc.stdout)
    return figures


def describe_wakeup(figures: dict[str, Any]) -> str:
    if "error" in figures:
        return f"wake-up probe failed: {figures['error']}"
    return describe(figures)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    main()
