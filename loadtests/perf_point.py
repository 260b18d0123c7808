"""Where a point's CPU goes, by shared object: ``perf record`` of the gateway or the floor, Python against
kernel against the C extensions (what ``bench_work.py``'s opcode counts cannot see).

Starts 2 fast prefills and 2 fast decodes (``fast_worker.py``) and the gateway over them, or the floor
(``floor_app.py``) alone, pinned as ``bench_stack.py`` pins them (server on core 0, the rest on core 1),
warms the point up, then records the server with ``perf record -g`` while the point runs, and prints
``perf report``'s share per shared object and its top symbols, with the CPU per request they add up to.
Needs ``perf`` (``linux-tools``) and a ``perf_event_paranoid`` that lets root record its own processes.

    .venv/bin/python loadtests/perf_point.py gateway|floor [--point ns|stream] [--requests N] [--top 25]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import Stack, http_target  # noqa: E402
from load_client import closed_loop  # noqa: E402
from pdtest import Procs  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402


async def record(args: argparse.Namespace, tmp: Path, out: Path) -> None:
    stream = args.point == "stream"
    stack = Stack(Procs(tmp))
    try:
        for i in range(2):
            stack.fast_worker(f"p{i}", "prefill", 0)
            stack.fast_worker(f"d{i}", "decode", 2.0 if stream else 0)
        stack.wait()
        name = "floor" if args.server == "floor" else "gw"
        if name == "floor":
            stack.http("floor", "loadtests/floor_app.py")
        else:
            stack.gateway("gw", *[("prefill", f"p{i}") for i in range(2)], *[("decode", f"d{i}") for i in range(2)])
        stack.wait()
        stack.pin()
        if {0, 1} <= os.sched_getaffinity(0):
            os.sched_setaffinity(0, {1})  # the client with the workers, as bench_stack runs it
        target = http_target(stack.ports[name], "/v1/chat/completions", 64 if stream else 16, stream)
        stagger_s = 0.13 if stream else 0.0  # (streams' starts spread over one stream's length, as bench_stack)
        await closed_loop(target, max(200, args.requests // 10), 64, stagger_s)
        perf = subprocess.Popen(["perf", "record", "-F", "4999", "-g", "-p", str(stack.pids[name]), "-o", str(out)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # (perf attached)
        await closed_loop(target, args.requests, 64, stagger_s)
        perf.send_signal(2)
        perf.wait()
    finally:
        stack.procs.stop_all()


def report(out: Path, requests: int, top: int) -> None:
    def lines(*sort: str) -> list[str]:
        text = subprocess.run(["perf", "report", "-i", str(out), "--no-children", "--sort", ",".join(sort),
                               "-g", "none", "--percent-limit", "0.3"], capture_output=True, text=True).stdout
        return [line for line in text.splitlines() if line.strip() and not line.startswith("#")]

    count = subprocess.run(["perf", "report", "-i", str(out), "--no-children", "--sort", "dso", "-g", "none"],
                           capture_output=True, text=True).stdout
    total_ns = next((float(line.split(":")[1]) for line in count.splitlines() if "Event count" in line), 0.0)
    print(f"{total_ns / 1e6:.0f} ms of CPU sampled over {requests} requests: {total_ns / 1e3 / requests:.1f} µs per "
          "request (perf's own overhead included)")
    print("by shared object:")
    for line in lines("dso"):
        print("  " + line)
    print(f"top {top} symbols:")
    for line in lines("dso", "sym")[:top]:
        print("  " + line)


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("server", choices=["gateway", "floor"])
    parser.add_argument("--point", choices=["ns", "stream"], default="stream")
    parser.add_argument("--requests", type=int, default=0, help="default: 20000 (ns), 1500 (stream)")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    args.requests = args.requests or (1500 if args.point == "stream" else 20000)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "perf.data"
        uvloop.run(record(args, Path(tmp), out))
        report(out, args.requests, args.top)


if __name__ == "__main__":
    main()
