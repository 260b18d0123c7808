"""A/B of two gateway trees: the same points, interleaved, over the same fast workers, in one run.

On a shared machine a single run's CPU figures move by 10-20% with whatever else runs, more than
most changes to the gateway; this benchmark compares two versions under the same conditions. It
starts 2 fast prefills, 2 fast decodes (tokens at once) and 2 fast decodes with a token gap
(``fast_worker.py``), then per tree (``--base``: a checkout of the version to compare with, e.g. from
``git worktree add /tmp/base <commit>`` or ``git archive <commit> | tar -x -C /tmp/base``; ``--head``:
default this repository) one gateway for the non-streaming points and one for the streaming points,
each started with ``python -m gateway.cli`` from its tree. Gateways on core 0, everything else on
core 1 (as ``bench_stack.py``). Each pair runs a point on A then B (the next pair B then A), and the
summary gives per point the medians of the gateway's CPU µs per request, B/A, and for streams the
client's TTFT p99.

Read a B/A figure against an A/A run (``--base`` a copy of the head itself): on the development VM
one such run gave B/A 1.066 for ``ns`` (B higher in 4 of 5 pairs) with the same code on both sides.

Points: ``ns`` (chat, 16 tokens, 64 concurrent), ``c1`` (the same, one at a time), ``stream`` (chat,
64 tokens, 2 ms token gap, 64 concurrent, starts staggered); ``sglang`` and ``sglang-c1``: chat, 16 tokens, 64
concurrent and one at a time, and ``sglang-stream`` (chat streamed, 64 tokens, 64 concurrent, the sim decode's own
pace), through the SGLang relay (``gateway/sglang_relay.py``), to a sim prefill + decode
(zero model cost) over their SGLang HTTP side, one more gateway per tree (the sim workers' own CPU, several ms
per request, bounds these points' rate, not the gateway's figure).

    .venv/bin/python loadtests/bench_ab.py --base /tmp/base [--head .] [--points ns,stream] [--pairs 5] \
        [--tokenizer "$(.venv/bin/python -m workers.engines.llama.gguf_convert)"]

(``gguf_convert`` with no arguments converts SmolLM2 once, into ``~/.cache/pd-gateway/smollm2-<version>``,
and prints that directory: it does not exist before the torch engine or this command first ran.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import SIM_OPTIONS, Stack, cpu_delta_s, cpu_sample, http_target, pin  # noqa: E402
from load_client import closed_loop, percentile  # noqa: E402
from pdtest import Procs, free_port, start_bootstrap, start_worker, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402

CHAT = "/v1/chat/completions"


@dataclass(frozen=True)
class PointSpec:
    stream: bool
    max_tokens: int
    concurrency: int
    num_requests: int
    sglang: bool = False  # over sim workers' SGLang HTTP side (the relay), not the fast native workers


POINTS = {
    "ns": PointSpec(False, 16, 64, 8000),
    "c1": PointSpec(False, 16, 1, 1500),
    "stream": PointSpec(True, 64, 64, 1000),
    "sglang": PointSpec(False, 16, 64, 1500, sglang=True),
    "sglang-c1": PointSpec(False, 16, 1, 600, sglang=True),
    "sglang-stream": PointSpec(True, 64, 64, 500, sglang=True),
}


def start_gateway(stack: Stack, name: str, tree: Path, workers: list[tuple[str, str]],
                  tokenizer: str | None = None, args: list[str] | None = None) -> None:
    port = free_port()
    args = args or [a for flag, worker in workers for a in (f"--{flag}", stack.url(worker))]
    if tokenizer is not None:
        args += ["--tokenizer", tokenizer]
    proc = stack.procs.start(name, "-m", "gateway.cli", *args, "--port", str(port), "--log-level", "warning",
                             cwd=tree)
    stack.pids[name], stack.ports[name] = proc.pid, port
    try:
        wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)
    except Exception as exc:
        raise RuntimeError(f"{name} did not start: {exc}\n{stack.procs.log(name)[-2000:]}") from exc


async def run(args: argparse.Namespace) -> None:
    trees = {"A": Path(args.base).resolve(), "B": Path(args.head).resolve()}
    for tag, tree in trees.items():
        if not (tree / "gateway" / "cli.py").exists():
            sys.exit(f"--{'base' if tag == 'A' else 'head'} {tree}: no gateway/cli.py there")
    points = args.points.split(",")
    unknown = set(points) - set(POINTS)
    if unknown:
        sys.exit(f"unknown points {sorted(unknown)}; known: {', '.join(POINTS)}")
    own_cpus = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="bench-ab-") as tmp:  # the processes' logs
        await _run(args, trees, points, Stack(Procs(Path(tmp))), own_cpus)


async def _run(args: argparse.Namespace, trees: dict[str, Path], points: list[str], stack: Stack,
               own_cpus: set[int]) -> None:
    try:
        for i in range(2):
            stack.fast_worker(f"prefill-{i}", "prefill", 0)
            stack.fast_worker(f"decode-{i}", "decode", 0)
            stack.fast_worker(f"decode-gap-{i}", "decode", args.token_gap_ms)
        stack.wait()
        http_args: list[str] = []
        if any(POINTS[key].sglang for key in points):  # sim workers, through their SGLang HTTP side
            boot = start_bootstrap(stack.procs)
            sims = {role: start_worker(stack.procs, role, *SIM_OPTIONS, bootstrap=boot, name=f"sim-{role}")
                    for role in ("prefill", "decode")}
            for role, worker in sims.items():
                stack.pids[f"sim-{role}"] = worker.proc.pid
            http_args = ["--prefill", f"http://127.0.0.1:{sims['prefill'].http_port}", boot.rsplit(":", 1)[1],
                         "--decode", f"http://127.0.0.1:{sims['decode'].http_port}"]
        prefills = [("prefill", "prefill-0"), ("prefill", "prefill-1")]
        for tag, tree in trees.items():
            start_gateway(stack, f"gw-{tag}", tree, [*prefills, ("decode", "decode-0"), ("decode", "decode-1")],
                          args.tokenizer)
            start_gateway(stack, f"gw-stream-{tag}", tree,
                          [*prefills, ("decode", "decode-gap-0"), ("decode", "decode-gap-1")], args.tokenizer)
            if http_args:
                start_gateway(stack, f"gw-http-{tag}", tree, [], args.tokenizer, http_args)
        can_pin = {0, 1} <= own_cpus
        if can_pin:
            for name, pid in stack.pids.items():
                pin(pid, {0} if name.startswith("gw") else {1})
            os.sched_setaffinity(0, {1})
        else:
            print("!! cores 0 and 1 not both available: nothing is pinned")
        figures: dict[tuple[str, str], list[tuple[float, float | None]]] = {}
        for pair in range(args.pairs):
            for key in points:
                spec = POINTS[key]
                for tag in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                    name = f"gw-http-{tag}" if spec.sglang else f"gw-stream-{tag}" if spec.stream else f"gw-{tag}"
                    target = http_target(stack.ports[name], CHAT, spec.max_tokens, spec.stream)
                    n = max(spec.concurrency, int(spec.num_requests * args.scale))
                    stagger = spec.max_tokens * args.token_gap_ms / 1000 if spec.stream else 0.0
                    await closed_loop(target, max(64, n // 10), spec.concurrency, stagger)  # warm
                    before = cpu_sample(stack.pids[name])
                    results = await closed_loop(target, n, spec.concurrency, stagger)
                    us = cpu_delta_s(before, cpu_sample(stack.pids[name])) / n * 1e6
                    ttfts = sorted(r.ttft_s for r in results if r.ttft_s is not None)
                    ttft_p99 = percentile(ttfts, 99) * 1e3 if ttfts else None
                    errors = sum(1 for r in results if r.error)
                    figures.setdefault((key, tag), []).append((us, ttft_p99))
                    extra = f"  TTFT p99 {ttft_p99:.2f} ms" if ttft_p99 is not None else ""
                    print(f"pair {pair + 1} {key:13} {tag}: {us:8.1f} µs/request{extra}"
                          + (f"  ({errors} errors)" if errors else ""), flush=True)
        print(f"\nA = {trees['A']}\nB = {trees['B']}")
        print(f"{'point':13} {'A µs/req':>10} {'B µs/req':>10} {'B/A':>6}   (medians of {args.pairs} pairs)")
        for key in points:
            a = statistics.median(x[0] for x in figures[(key, "A")])
            b = statistics.median(x[0] for x in figures[(key, "B")])
            line = f"{key:13} {a:10.1f} {b:10.1f} {b / a:6.3f}"
            ttft = [statistics.median(x[1] for x in figures[(key, tag)] if x[1] is not None)
                    for tag in "AB"] if POINTS[key].stream else []
            if ttft:
                line += f"   client TTFT p99 A {ttft[0]:.2f} ms, B {ttft[1]:.2f} ms"
            print(line)
    finally:
        stack.procs.stop_all()
        os.sched_setaffinity(0, own_cpus)


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="tree A: a checkout of the version to compare with")
    ap.add_argument("--head", default=str(REPO), help="tree B (default: this repository)")
    ap.add_argument("--points", default="ns,stream", help=f"comma-separated: {', '.join(POINTS)}")
    ap.add_argument("--pairs", type=int, default=5, help="A/B pairs per point")
    ap.add_argument("--scale", type=float, default=1.0, help="requests per point, relative to the defaults")
    ap.add_argument("--token-gap-ms", type=float, default=2.0, help="streaming points: decode token gap")
    ap.add_argument("--tokenizer", default=None,
                    help="both gateways' --tokenizer: a model directory, to measure with a real model's tokenizer "
                         "(default: the fast workers' byte tokenizer)")
    uvloop.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
