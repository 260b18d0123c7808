"""A/B of ``--gather-ms``: two gateways in front of the same sim prefill + decode, alternated, one run.

A whole (non-streamed) response asks its decode to gather the tokens after the
first (``Submit.gather_s``). This benchmark measures what that saves: it starts a bootstrap registry,
one sim prefill and one sim decode at zero model cost (``bench_stack.SIM_OPTIONS``), and two
gateways in front of both, one with ``--gather-ms 0`` (every step's output, the baseline) and one
with ``--gather-ms <value>``. Gateways on core 0, everything else on core 1 (as ``bench_stack.py``).
Per pair it runs the same closed-loop point (chat, non-streaming) on each gateway, swapping which goes
first every pair, and prints requests/s and the CPU µs per request of the gateway, the prefill and the
decode; then the medians per gateway and their ratio.

With ``--stop TEXT`` every request carries a stop string: gathered only because our decodes end
requests at stop strings themselves (``HelloAck.stop_strings``); before that, such a response was sent
one output per step, as the ``--gather-ms 0`` gateway does.

    .venv/bin/python loadtests/bench_gather.py [--gather-ms 50] [--concurrency 64] [--tokens 16] [--pairs 4] \
        [--stop TEXT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import SIM_OPTIONS, Stack, cpu_delta_s, cpu_sample, http_target, pin  # noqa: E402
from load_client import closed_loop  # noqa: E402
from pdtest import Procs, free_port, start_bootstrap, start_worker, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

CHAT = "/v1/chat/completions"
WORKERS = ("sim-prefill", "sim-decode")


async def run(args: argparse.Namespace) -> None:
    own_cpus = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="bench-gather-") as tmp:
        stack = Stack(Procs(Path(tmp)))
        try:
            boot = start_bootstrap(stack.procs)
            for name, role in zip(WORKERS, ("prefill", "decode"), strict=True):
                worker = start_worker(stack.procs, role, *SIM_OPTIONS, bootstrap=boot, name=name)
                stack.pids[name], stack.ports[name] = worker.proc.pid, worker.port
            gateways = {"gather 0": 0.0, f"gather {args.gather_ms:g}": args.gather_ms}
            for name, gather_ms in gateways.items():
                port = free_port()
                proc = stack.procs.start(name.replace(" ", "-"), "-m", "gateway.cli", "--prefill",
                                         stack.url("sim-prefill"), "--decode", stack.url("sim-decode"), "--port",
                                         str(port), "--log-level", "warning", "--gather-ms", f"{gather_ms:g}",
                                         cwd=REPO)
                stack.pids[name], stack.ports[name] = proc.pid, port
                wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)
            for name, pid in stack.pids.items():
                pin(pid, {0} if name in gateways else {1})
            os.sched_setaffinity(0, {1})
            await _pairs(args, stack, list(gateways))
        finally:
            stack.procs.stop_all()
            os.sched_setaffinity(0, own_cpus)


async def _pairs(args: argparse.Namespace, stack: Stack, gateways: list[str]) -> None:
    targets = {name: http_target(stack.ports[name], CHAT, args.tokens, False) for name in gateways}
    if args.stop is not None:  # every request with this stop string (one that never matches: full length)
        targets = {name: dataclasses.replace(t, body=json.dumps({**json.loads(t.body), "stop": [args.stop]}).encode())
                   for name, t in targets.items()}
    for target in targets.values():  # warm-up: connections, caches, the first requests' imports
        await closed_loop(target, 4 * args.concurrency, args.concurrency)
    rows: dict[str, list[tuple[float, ...]]] = {name: [] for name in gateways}
    stop = f", stop {args.stop!r}" if args.stop is not None else ""
    print(f"chat non-stream {args.tokens} tokens{stop}, closed loop c={args.concurrency}, {args.requests} requests "
          "per run")
    for pair in range(args.pairs):
        for name in gateways if pair % 2 == 0 else gateways[::-1]:
            procs = {name: stack.pids[name], **{w: stack.pids[w] for w in WORKERS}}
            before = {k: cpu_sample(pid) for k, pid in procs.items()}
            started = time.monotonic()
            results = await closed_loop(targets[name], args.requests, args.concurrency)
            wall_s = time.monotonic() - started
            errors = sum(1 for r in results if r.error)
            cpu = [cpu_delta_s(before[k], cpu_sample(pid)) * 1e6 / args.requests for k, pid in procs.items()]
            rows[name].append((args.requests / wall_s, *cpu))
            print(f"pair {pair + 1} {name:>10}: {args.requests / wall_s:7,.0f} req/s  CPU µs/request: gateway "
                  f"{cpu[0]:6.1f}  prefill {cpu[1]:6.1f}  decode {cpu[2]:6.1f}  errors {errors}", flush=True)
    medians = {name: [statistics.median(col) for col in zip(*r, strict=True)] for name, r in rows.items()}
    base, gathered = (medians[name] for name in gateways)
    print(f"\n{'medians':>18} {'req/s':>8} {'gateway':>8} {'prefill':>8} {'decode':>8}   (CPU µs/request)")
    for name in gateways:
        m = medians[name]
        print(f"{name:>18} {m[0]:8,.0f} {m[1]:8.1f} {m[2]:8.1f} {m[3]:8.1f}")
    print(f"{'ratio':>18} " + " ".join(f"{g / b:8.3f}" for g, b in zip(gathered, base, strict=True)))


def main(argv: list[str] | None = None) -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    p = argparse.ArgumentParser(prog="bench_gather", description=__doc__.splitlines()[0])
    p.add_argument("--gather-ms", type=float, default=50.0, help="the gathering gateway's --gather-ms")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tokens", type=int, default=16, help="max_tokens per request")
    p.add_argument("--requests", type=int, default=1500, help="requests per run")
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--stop", default=None, metavar="TEXT",
                   help="send every request with this stop string (pick one the output never holds: each request "
                        "then runs its full length); a decode that stops at strings itself gathers these too")
    args = p.parse_args(argv)
    if args.gather_ms <= 0:
        p.error("--gather-ms must be positive (the baseline gateway is the one with 0)")
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
