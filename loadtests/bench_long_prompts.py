"""Long prompts against everything else: what tokenizing a long prompt on the event loop costs others.

A gateway tokenizes every prompt (its routing and accounting need the ids). A long one with a real
model's tokenizer takes milliseconds (SmolLM2's: about 12 ms for 5,000 tokens), and on the event loop
those are milliseconds in which no other request or stream gets anything. Since 2026-12-02 a request
body of ``--prepare-thread-bytes`` (8 KiB) or more is prepared on a thread (the tokenizer releases the
GIL while it works); this benchmark measures that against ``--prepare-thread-bytes 0`` in one run.

Setup: a fast prefill and a fast decode (``fast_worker.py``, tokens at once), two gateways in front of
them with a model's tokenizer (``--tokenizer``, default SmolLM2's), A with ``--prepare-thread-bytes 0``
and B with the default. Per pair (A then B, the next B then A): a probe sends short chats (4 tokens)
one at a time while long-prompt chats (``--prompt-kib`` of text each, every one different so that no
piece of it is known to the gateway, 1 token each, made beforehand) arrive every ``--every-ms``.
Printed per gateway: the probe's latency p50 / p99 / max (the longest the gateway kept a short
request waiting) and the long requests' latency p50. The workers and the client run on core 1; the
gateways are not pinned (a prepare thread may use the other core).

    .venv/bin/python loadtests/bench_long_prompts.py [--pairs 3] [--tokenizer DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import uvloop

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "loadtests")]

from bench_stack import Stack, http_target, pin  # noqa: E402
from load_client import HttpTarget, _close, _connect, _now, closed_loop, percentile  # noqa: E402
from pdtest import Procs, free_port, wait_http_ok  # noqa: E402
from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

CHAT = "/v1/chat/completions"
WORDS = ["retrieval", "augmented", "generation", "sends", "the", "documents", "it", "found", "along", "with",
         "the", "question,", "so", "prompts", "of", "thousands", "of", "tokens", "are", "common;"]


def long_body(kib: int, nonce: int) -> bytes:
    words, size, i = [f"document {nonce}:"], 0, nonce
    while size < kib * 1024:
        word = WORDS[i % len(WORDS)] + ("" if i % 7 else f" {i}")
        words.append(word)
        size += len(word) + 1
        i += 1
    content = " ".join(words)
    return json.dumps({"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": 1}).encode()


def start_gateway(stack: Stack, name: str, tokenizer: str, *extra: str) -> None:
    port = free_port()
    proc = stack.procs.start(name, "-m", "gateway.cli", "--prefill", stack.url("prefill"), "--decode",
                             stack.url("decode"), "--tokenizer", tokenizer, "--port", str(port), "--log-level",
                             "warning", *extra, cwd=REPO)
    stack.pids[name], stack.ports[name] = proc.pid, port
    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)


async def long_requests(port: int, bodies: list[bytes], every_s: float, stop: asyncio.Event,
                        latencies: list[float]) -> int:
    """One long-prompt chat every ``every_s`` (each on its own connection, so none waits for another;
    the bodies made beforehand, so that the client's own loop is not held making them) until
    ``stop``; returns how many were sent."""
    sent = 0
    tasks = []

    async def one(body: bytes) -> None:
        target = HttpTarget("127.0.0.1", port, CHAT, body, False)
        conn = await _connect(target)
        try:
            result = await conn.exchange(target.request, _now(), False, 0)
        finally:
            _close([conn])
        if result.error is None:
            latencies.append(result.latency_s)

    while not stop.is_set() and sent < len(bodies):
        tasks.append(asyncio.create_task(one(bodies[sent])))
        sent += 1
        await asyncio.sleep(every_s)
    await asyncio.gather(*tasks)
    return sent


async def run(args: argparse.Namespace) -> None:
    own_cpus = os.sched_getaffinity(0)
    with tempfile.TemporaryDirectory(prefix="bench-long-") as tmp:
        stack = Stack(Procs(Path(tmp)))
        try:
            stack.fast_worker("prefill", "prefill", 0)
            stack.fast_worker("decode", "decode", 0)
            stack.wait()
            start_gateway(stack, "gw-A", args.tokenizer, "--prepare-thread-bytes", "0")
            start_gateway(stack, "gw-B", args.tokenizer)
            if {0, 1} <= own_cpus:
                for name, pid in stack.pids.items():
                    if not name.startswith("gw"):
                        pin(pid, {1})
                os.sched_setaffinity(0, {1})
            figures: dict[str, list[tuple[float, float, float, float, float]]] = {"A": [], "B": []}
            nonce = 0
            for pair in range(args.pairs):
                for tag in ("A", "B") if pair % 2 == 0 else ("B", "A"):
                    port = stack.ports[f"gw-{tag}"]
                    probe = http_target(port, CHAT, 4, False)
                    await closed_loop(probe, 100, 1)  # warm
                    stop = asyncio.Event()
                    latencies: list[float] = []
                    bodies = [long_body(args.prompt_kib, nonce + i) for i in range(args.max_long)]
                    sender = asyncio.create_task(long_requests(port, bodies, args.every_ms / 1000, stop, latencies))
                    results = await closed_loop(probe, args.probes, 1)
                    stop.set()
                    nonce += await sender
                    lat = sorted(r.latency_s for r in results if r.error is None)
                    row = (percentile(lat, 50) * 1e3, percentile(lat, 99) * 1e3, lat[-1] * 1e3,
                           statistics.median(latencies) * 1e3 if latencies else 0.0, float(len(latencies)))
                    figures[tag].append(row)
                    print(f"pair {pair + 1} {tag}: probe latency p50 {row[0]:.2f} p99 {row[1]:.2f} max {row[2]:.1f} "
                          f"ms; {len(latencies)} long prompts, latency p50 {row[3]:.1f} ms; probe errors "
                          f"{len(results) - len(lat)}", flush=True)
            print(f"\nA: --prepare-thread-bytes 0 (every prompt tokenized on the event loop); B: the default "
                  f"(bodies of 8 KiB or more on a thread). {args.prompt_kib} KiB prompts every {args.every_ms:g} ms; "
                  f"medians of {args.pairs} pairs:")
            print(f"{'':3} {'probe p50':>10} {'probe p99':>10} {'probe max':>10} {'long p50':>9}   (ms)")
            for tag in "AB":
                med = [statistics.median(row[i] for row in figures[tag]) for i in range(4)]
                print(f"{tag:3} {med[0]:10.2f} {med[1]:10.2f} {med[2]:10.1f} {med[3]:9.1f}")
        finally:
            stack.procs.stop_all()
            os.sched_setaffinity(0, own_cpus)


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=None, help="a model directory (default: SmolLM2's, converted once)")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--probes", type=int, default=1500, help="short requests per point (one at a time)")
    ap.add_argument("--prompt-kib", type=int, default=20, help="text per long prompt")
    ap.add_argument("--every-ms", type=float, default=100.0, help="a long prompt this often")
    ap.add_argument("--max-long", type=int, default=200, help="long prompts made beforehand per point (at most)")
    args = ap.parse_args()
    if args.tokenizer is None:
        from workers.engines.llama.gguf_convert import default_model_dir

        args.tokenizer = default_model_dir()
    uvloop.run(run(args))


if __name__ == "__main__":
    main()
