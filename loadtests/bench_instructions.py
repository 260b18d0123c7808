"""Machine instructions per request of the gateway and of the Python floor, counted by valgrind's callgrind.

``bench_work.py`` counts bytecode, which does not weigh what a bytecode costs (a class attribute read through an
instance, a builtin called with several arguments, an object made and freed) nor the C code it runs in (uvloop,
httptools, msgspec); timing on this machine drifts by more than a change's effect. Callgrind counts every
instruction the process executes, the same count on every run of the same code, so two versions compare to a
fraction of a percent. What it does not count is the kernel's side (system calls, wake-ups) and waiting.

The floor (``floor_app.py``) and the gateway each run under ``valgrind --tool=callgrind`` (some 50 times slower;
start-up takes a minute), over 2 fast prefills and 2 fast decodes that run natively (``fast_worker.py``). Per
point: a warm-up, then the counters are zeroed (``callgrind_control --zero``), ``--requests`` requests run (closed
loop, 64 concurrent), and the counters are dumped (``callgrind_control --dump``): instructions per request, the
whole process (every thread; its background loops over the point's duration included, which a slowed process
stretches: a little more for a slower version). Needs ``valgrind`` (Debian's package).

    .venv/bin/python loadtests/bench_instructions.py [--tree /tmp/base] [--points ns,stream] [--requests 1000]
        [--workers 2]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import Stack, http_target  # noqa: E402
from bench_work import fast_fleet  # noqa: E402
from load_client import closed_loop  # noqa: E402
from pdtest import Procs, free_port, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402

CHAT = "/v1/chat/completions"
# ``python -c`` that becomes valgrind running this same interpreter on the rest of its arguments (same PID: the
# process ``Procs`` started and will stop is the one counted)
_EXEC_VALGRIND = ("import os, sys; os.execvp('valgrind', ['valgrind', '--tool=callgrind', '--callgrind-out-file=' "
                  "+ sys.argv[1], sys.executable, *sys.argv[2:]])")


def start_counted(stack: Stack, name: str, out: Path, cwd: Path, *args: str) -> None:
    port = free_port()
    proc = stack.procs.start(name, "-c", _EXEC_VALGRIND, str(out), *args, "--port", str(port), "--log-level",
                             "warning", cwd=cwd, env={"PYTHONPATH": str(cwd), "PYTHONHASHSEED": "0"})
    stack.pids[name], stack.ports[name] = proc.pid, port


async def _control(pid: int, action: str, target: Any) -> None:
    """``callgrind_control --<action> pid``; the process is polled for it only while it runs, so a request is sent
    alongside (one request more or less in a point of a thousand)."""
    proc = await asyncio.create_subprocess_exec("callgrind_control", f"--{action}", str(pid),
                                                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), 0.5)
            return
        except TimeoutError:
            await closed_loop(target, 1, 1, 0.0)


async def wait_for_dump(out: Path, before: int, name: str) -> None:
    """Until callgrind has written a dump of ``out`` past the ``before`` there were (and a moment more: whole)."""
    deadline = time.monotonic() + 60
    while len(list(out.parent.glob(f"{out.name}.*"))) <= before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{name} wrote no dump")
        await asyncio.sleep(0.2)
    await asyncio.sleep(0.5)  # (written whole)


def keep_dumps(tmp: Path, keep: str | None) -> None:
    """Copy the dumps (``*.cg.*``) to ``keep`` (``--keep``: for callgrind_annotate), if given."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        for dump in tmp.glob("*.cg.*"):
            shutil.copy(dump, Path(keep) / dump.name)


def need_valgrind(tool: str) -> None:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        sys.exit(f"{tool}: needs valgrind (apt-get install valgrind)")


def _instructions(out: Path, pid: int) -> int:
    """The ``summary`` of the newest dump of ``pid`` (callgrind names dumps ``OUT.N``)."""
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no summary in {dumps[-1]} (pid {pid})")


async def count(stack: Stack, name: str, out: Path, stream: bool, tokens: int, requests: int,
                stagger_s: float) -> float:
    target = http_target(stack.ports[name], CHAT, tokens, stream)
    await closed_loop(target, 128, 64, stagger_s)
    pid = stack.pids[name]
    dumps = len(list(out.parent.glob(f"{out.name}.*")))  # (one process may be counted for two points)
    await _control(pid, "zero", target)
    results = await closed_loop(target, requests, 64, stagger_s)
    await _control(pid, "dump", target)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
    await wait_for_dump(out, dumps, name)
    return _instructions(out, pid) / requests


async def run(args: argparse.Namespace, tmp: Path) -> None:
    tree = Path(args.tree).resolve()
    points = set(args.points.split(","))
    stack = Stack(Procs(tmp))
    outs = {name: tmp / f"{name}.cg" for name in ("floor", "gw", "gw-stream")}
    try:
        start_counted(stack, "floor", outs["floor"], REPO, "loadtests/floor_app.py", "--token-gap-ms",
                      str(args.token_gap_ms))
        workers, gap_workers = fast_fleet(stack, args.token_gap_ms, args.workers)
        start_counted(stack, "gw", outs["gw"], tree, "-m", "gateway.cli", *workers)
        if "stream" in points:
            start_counted(stack, "gw-stream", outs["gw-stream"], tree, "-m", "gateway.cli", *gap_workers)
        by_pid = {p.pid: p for p in stack.procs.procs}
        wait_http_ok(f"http://127.0.0.1:{stack.ports['floor']}/", 300, by_pid[stack.pids["floor"]])
        for name in ("gw", "gw-stream") if "stream" in points else ("gw",):
            wait_http_ok(f"http://127.0.0.1:{stack.ports[name]}/readiness", 300, by_pid[stack.pids[name]])
        n, s = args.requests, max(64, args.requests // 4)
        stagger = 64 * args.token_gap_ms / 1000
        figures: dict[str, float] = {}
        for key, name, stream, tokens, requests in (("floor ns", "floor", False, 16, n),
                                                    ("gateway ns", "gw", False, 16, n),
                                                    ("floor stream", "floor", True, 64, s),
                                                    ("gateway stream", "gw-stream", True, 64, s)):
            if key.split()[1] not in points:
                continue
            figures[key] = await count(stack, name, outs[name], stream, tokens, requests, stagger if stream else 0.0)
            print(f"{key:16} {figures[key]:12,.0f} instructions/request  ({requests} requests)", flush=True)
    finally:
        stack.procs.stop_all()
        keep_dumps(tmp, args.keep)
    print(f"\ngateway tree: {tree}")
    if "ns" in points:
        f_ns, g_ns = figures["floor ns"], figures["gateway ns"]
        print(f"ns: gateway / floor = {g_ns / f_ns:.2f} ({g_ns:,.0f} / {f_ns:,.0f} instructions per request)")
        if "stream" in points:
            f_tok = (figures["floor stream"] - f_ns) / 64
            g_tok = (figures["gateway stream"] - g_ns) / 64
            print(f"stream, per token above ns: gateway {g_tok:,.0f}, floor {f_tok:,.0f} instructions")


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(REPO), help="the gateway's checkout to count (default: this one)")
    ap.add_argument("--requests", type=int, default=1000, help="non-streaming requests per point (streams: 1/4)")
    ap.add_argument("--token-gap-ms", type=float, default=50.0)
    ap.add_argument("--points", default="ns", help="ns, stream (needs ns), comma-separated")
    ap.add_argument("--workers", type=int, default=2, help="fast prefills and fast decodes behind the gateway, each")
    ap.add_argument("--keep", help="copy the dumps here (for callgrind_annotate: where the instructions go)")
    args = ap.parse_args()
    need_valgrind("bench_instructions")
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        uvloop.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
