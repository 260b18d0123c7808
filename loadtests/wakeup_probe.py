"""How fast this machine wakes a process for a loopback message: a one-byte TCP ping-pong.

Every latency figure of ``bench_stack.py`` crosses processes: client -> gateway -> workers -> gateway
-> client, with the gateway on core 0 and everything else on core 1. Each crossing from one core to
the other wakes a sleeping process there; on a bare machine that costs tens of µs, but in a virtual
machine an idle virtual CPU is woken through the hypervisor, which can cost far more and varies with
what else the host runs. This probe measures that cost in the same run, so a TTFT figure can be read
against it: a 1-byte ping-pong over loopback TCP (``TCP_NODELAY``) between an echo process and this
one, both on the same core and on different cores, with a short sleep every few rounds so both sides
keep going idle as they do under a real load.

    .venv/bin/python loadtests/wakeup_probe.py [--rounds 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from typing import Any

from load_client import percentile


def _echo(listener: socket.socket, cpu: int) -> None:
    """The child: pinned to ``cpu``, echoes every read until the peer closes."""
    os.sched_setaffinity(0, {cpu})
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while data := conn.recv(64):
        conn.sendall(data)


def round_trips(echo_cpu: int, own_cpu: int, rounds: int) -> list[float]:
    """Seconds per ping-pong with the echo on ``echo_cpu`` and this process on ``own_cpu``."""
    own_cpus = os.sched_getaffinity(0)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        pid = os.fork()
        if pid == 0:  # (no threads or event loop here: this runs before anything else in the caller)
            try:
                _echo(listener, echo_cpu)
            finally:
                os._exit(0)
        try:
            os.sched_setaffinity(0, {own_cpu})
            with socket.create_connection(listener.getsockname()) as sock:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                out = []
                for i in range(rounds):
                    if i % 8 == 0:
                        time.sleep(0.0005)  # both sides go idle, as between a load's messages
                    start = time.perf_counter()
                    sock.sendall(b"x")
                    if not sock.recv(64):
                        raise ConnectionError("the echo process closed the connection")
                    out.append(time.perf_counter() - start)
        finally:
            os.sched_setaffinity(0, own_cpus)
            os.waitpid(pid, 0)
    return out


def measure(rounds: int = 2000) -> dict[str, Any]:
    """Round-trip percentiles in µs, same core and across cores (None where cores 0 and 1 are not both ours)."""
    def summary(samples: list[float]) -> dict[str, float]:
        samples = sorted(samples)
        pick = lambda q: percentile(samples, q) * 1e6  # noqa: E731  (nearest rank, as load_client's)
        return {"p50_us": pick(50), "p90_us": pick(90), "p99_us": pick(99)}

    if not {0, 1} <= os.sched_getaffinity(0):
        return {"same_core": None, "cross_core": None}
    return {"same_core": summary(round_trips(1, 1, rounds)), "cross_core": summary(round_trips(0, 1, rounds))}


def describe(figures: dict[str, Any]) -> str:
    parts = []
    for key, label in (("cross_core", "across cores"), ("same_core", "on one core")):
        f = figures.get(key)
        if f is not None:
            parts.append(f"{label} p50 {f['p50_us']:.0f} / p90 {f['p90_us']:.0f} / p99 {f['p99_us']:.0f} µs")
    return "loopback ping-pong round trip " + ("; ".join(parts) if parts else "not measured (cores 0, 1 not ours)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args()
    figures = measure(args.rounds)
    print(json.dumps(figures) if args.json else describe(figures))


if __name__ == "__main__":
    main()
