"""Machine instructions per request of the PD workers and of a combined worker, counted by valgrind's callgrind.

The whole-stack goal at one request at a time (PD p50 within 1 ms of the combined worker's) is a matter of the
workers' CPU: the prefill, the decode and the client share a core, and a request's latency is about the sum of
what they spend on it. Timing that on this machine drifts by more than a change's effect; callgrind's count does
not (see ``bench_instructions.py``, which counts the gateway the same way).

Each worker (sim engine at zero cost, ``bench_stack.SIM_OPTIONS``) runs under ``valgrind --tool=callgrind
--instr-atstart=no`` (start-up natively fast enough; some 50 times slower once counting), the registry and the
gateway natively. Per point: a warm-up, then counting is switched on in every counted worker
(``callgrind_control --instr=on``), ``--requests`` chat requests of 16 tokens run one at a time through the
gateway, counting is switched off and dumped: instructions per request per worker process (every thread; its
background loops over the point's duration included, which the slowed process stretches). The combined worker
(``--role both``) is the same run's baseline: "PD above combined" = prefill + decode - combined. Needs valgrind.

    .venv/bin/python loadtests/bench_worker_instructions.py [--tree /tmp/base] [--requests 200] [--keep DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_instructions import _control, keep_dumps, need_valgrind, wait_for_dump  # noqa: E402
from bench_stack import SIM_OPTIONS, Stack, http_target  # noqa: E402
from load_client import closed_loop  # noqa: E402
from pdtest import Procs, free_port, start_bootstrap, start_gateway, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402

CHAT = "/v1/chat/completions"
_EXEC_VALGRIND = ("import os, sys; os.execvp('valgrind', ['valgrind', '--tool=callgrind', '--instr-atstart=no', "
                  "'--callgrind-out-file=' + sys.argv[1], sys.executable, *sys.argv[2:]])")


def start_counted_worker(stack: Stack, name: str, out: Path, tree: Path, role: str, bootstrap: str | None) -> None:
    port, http_port = free_port(), free_port()
    args = ["-m", "workers.cli", "--role", role, "--port", str(port), "--http-port", str(http_port), "--log-level",
            "warning", *SIM_OPTIONS, *(("--bootstrap", bootstrap) if bootstrap else ())]
    proc = stack.procs.start(name, "-c", _EXEC_VALGRIND, str(out), *args, cwd=tree,
                             env={"PYTHONPATH": str(tree), "PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1"})
    stack.pids[name], stack.ports[name] = proc.pid, port
    wait_http_ok(f"http://127.0.0.1:{http_port}/health", 300, proc)


def _totals(out: Path) -> int:
    """The ``totals`` of the newest dump (callgrind names dumps ``OUT.N``; with counting switched on late, its
    ``summary`` line reads 0)."""
    dumps = sorted(out.parent.glob(f"{out.name}.*"), key=lambda p: p.stat().st_mtime)
    for line in dumps[-1].read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {dumps[-1]}")


async def count(stack: Stack, gateway_port: int, names: list[str], outs: dict[str, Path],
                requests: int) -> dict[str, float]:
    """Instructions per request of each of ``names`` (counted workers) over ``requests`` requests at c1."""
    target = http_target(gateway_port, CHAT, 16, False)
    await closed_loop(target, 50, 1, 0.0)
    for name in names:
        await _control(stack.pids[name], "zero", target)
        await _control(stack.pids[name], "instr=on", target)
    results = await closed_loop(target, requests, 1, 0.0)
    dumps = {name: len(list(outs[name].parent.glob(f"{outs[name].name}.*"))) for name in names}
    for name in names:
        await _control(stack.pids[name], "instr=off", target)
        await _control(stack.pids[name], "dump", target)
    errors = [r.error for r in results if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    figures = {}
    for name in names:
        await wait_for_dump(outs[name], dumps[name], name)
        figures[name] = _totals(outs[name]) / requests
    return figures


async def run(args: argparse.Namespace, tmp: Path) -> None:
    tree = Path(args.tree).resolve()
    figures: dict[str, float] = {}
    for point, roles in (("pd", ("prefill", "decode")), ("both", ("both",))):
        stack = Stack(Procs(tmp))
        outs = {role: tmp / f"{role}.cg" for role in roles}
        try:
            bootstrap = start_bootstrap(stack.procs) if point == "pd" else None
            for role in roles:
                start_counted_worker(stack, role, outs[role], tree, role, bootstrap)
            flags = {"prefill": "--prefill", "decode": "--decode", "both": "--worker"}
            port = start_gateway(stack.procs, *(a for role in roles
                                                for a in (flags[role], f"pd://127.0.0.1:{stack.ports[role]}")))
            figures.update(await count(stack, port, list(roles), outs, args.requests))
        finally:
            stack.procs.stop_all()
            keep_dumps(tmp, args.keep)
            for dump in tmp.glob("*.cg*"):
                dump.unlink()
        for role in roles:
            print(f"{role:8} {figures[role]:12,.0f} instructions/request  ({args.requests} requests, c1)", flush=True)
    above = figures["prefill"] + figures["decode"] - figures["both"]
    print(f"\nworkers' tree: {tree}")
    print(f"PD (prefill + decode) {figures['prefill'] + figures['decode']:,.0f}, combined {figures['both']:,.0f}: "
          f"PD above combined {above:,.0f} instructions per request")


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the processes are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", default=str(REPO), help="the workers' checkout to count (default: this one)")
    ap.add_argument("--requests", type=int, default=200, help="requests per point, one at a time")
    ap.add_argument("--keep", help="copy the dumps here (for callgrind_annotate: where the instructions go)")
    args = ap.parse_args()
    need_valgrind("bench_worker_instructions")
    with tempfile.TemporaryDirectory(prefix="bench-worker-instructions-") as tmp:
        uvloop.run(run(args, Path(tmp)))


if __name__ == "__main__":
    main()
