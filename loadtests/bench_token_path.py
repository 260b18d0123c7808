"""A streamed token's way through the gateway's decode connection, timed in-process: no sockets, no client.

32 streams are in their steady state (``Dispatcher.generate`` with a direct consumer that keeps nothing), their
decode connection a real ``WorkerClient`` over a transport that keeps what is written; then frames of one output
per stream are handed to the connection's frame dispatch (``WorkerClient._dispatch``) as a decode's frames are,
and the time per token is taken (the best of ``--reps`` passes of ``--frames`` frames). This is the part of a
token's cost that is the gateway's own Python, without the kernel's send, the HTTP chunk or the detokenizer,
which ``bench_stack.py``'s end-to-end figures cannot separate from the machine's drift.

With ``--base TREE`` the same measurement runs alternately in a process of each tree (``--rounds`` times) and the
medians are compared, as ``bench_ab.py`` does end to end:

    .venv/bin/python loadtests/bench_token_path.py [--base /tmp/base] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STREAMS = 32


async def measure(frames: int, reps: int) -> float:
    """ns per token, the best of ``reps`` passes (run in the tree on ``sys.path``)."""
    from test_hot_path import RecordingConsumer, _connected_workers, _sent

    from gateway.dispatch import Dispatcher
    from gateway.policies.simple import RoundRobinPolicy
    from gateway.router import Router
    from workers.protocol import Outputs, SamplingParams, StepOutput, Submit

    class Discards(RecordingConsumer):
        def take(self, output: StepOutput) -> None:
            pass

    loop = asyncio.get_running_loop()
    prefills, _ = _connected_workers(loop, "prefill", 1)
    decodes, transports = _connected_workers(loop, "decode", 1)
    policy = RoundRobinPolicy()
    dispatcher = Dispatcher(prefills, decodes, Router(policy, policy))

    async def stream() -> None:
        async for _ in dispatcher.generate([1, 2, 3], SamplingParams(max_new_tokens=1000), direct=Discards()):
            pass

    tasks = [asyncio.create_task(stream()) for _ in range(STREAMS)]
    try:
        for _ in range(50):
            await asyncio.sleep(0)
        rids = [m.rid for m in _sent(transports[0], Submit)]
        if len(rids) != STREAMS:
            raise RuntimeError(f"{len(rids)} of {STREAMS} streams submitted")
        decode = decodes[0]
        decode._dispatch(Outputs([StepOutput(rid, [65]) for rid in rids]))  # the first tokens: steady from now on
        batch = [Outputs([StepOutput(rid, [66]) for rid in rids]) for _ in range(frames)]
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            for frame in batch:
                decode._dispatch(frame)
            best = min(best, (time.perf_counter() - t0) / (frames * STREAMS) * 1e9)
        if any(task.done() for task in tasks):
            raise RuntimeError("a stream ended during the measurement")
        return best
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def run_tree(tree: Path, frames: int, reps: int) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", str(tree), "--frames", str(frames), "--reps", str(reps)],
                         capture_output=True, text=True, check=True, cwd=tree)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", help="another checkout to compare with (run alternately)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--frames", type=int, default=200, help="frames per pass (one output per stream each)")
    parser.add_argument("--reps", type=int, default=20, help="passes per measurement (the best is kept)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        tree = Path(args.child)
        sys.path[:0] = [str(tree), str(tree / "tests"), str(tree / "tests" / "gateway")]
        print(f"{asyncio.run(measure(args.frames, args.reps)):.1f}")
        return
    trees = [("head", REPO)] + ([("base", Path(args.base).resolve())] if args.base else [])
    figures: dict[str, list[float]] = {name: [] for name, _ in trees}
    for i in range(args.rounds):
        order = trees if i % 2 == 0 else trees[::-1]  # (alternating who goes first: the machine drifts)
        for name, tree in order:
            figures[name].append(run_tree(tree, args.frames, args.reps))
        print(f"round {i + 1}: " + ", ".join(f"{name} {figures[name][-1]:.1f}" for name, _ in trees) + " ns/token")
    medians = {name: statistics.median(values) for name, values in figures.items()}
    print(f"{STREAMS} streams in their steady state, a decode frame's dispatch per token (in-process), medians of "
          f"{args.rounds}: " + ", ".join(f"{name} {value:.1f} ns" for name, value in medians.items()))
    if args.base:
        print(f"head / base = {medians['head'] / medians['base']:.3f}  (base: {trees[1][1]})")


if __name__ == "__main__":
    main()
