"""Benchmark the bootstrap registry: look-ups/s and registrations/s with CPU-µs per request.

Starts a real ``pd-bootstrap`` process on a free loopback port, drives it with a minimal keep-alive
HTTP/1.1 client (raw asyncio streams, so the client costs little), and reads the server's CPU time
from ``/proc/<pid>/stat`` before and after each phase. ``GET /health`` (no state, no JSON) is the
floor measured in the same run; every other row is compared with it. The last rows time our own
clients (``BootstrapResolver`` uncached and cached; ``BootstrapRegistrar`` heartbeats via its PUT).

    .venv/bin/python loadtests/bench_bootstrap.py [--requests 10000] [--concurrency 8] [--token]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stop_signals import stop_like_ctrl_c  # noqa: E402  (this folder: the script's own)

from bootstrap import BootstrapRegistrar, BootstrapResolver, RankRegistration  # noqa: E402

CLK_TCK = os.sysconf("SC_CLK_TCK")
TP = 8


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process, in seconds (/proc/<pid>/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rank_body(i: int, *, instance_id: str = "bench", tp_size: int = TP) -> dict[str, object]:
    return {
        "attn_tp_size": tp_size, "attn_tp_rank": i % tp_size, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0, "system_dp_size": 1,
        "system_dp_rank": 0, "rank_ip": "127.0.0.1", "rank_port": 20000 + i % tp_size, "page_size": 16,
        "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room", "prefill_http_port": 30000,
        "instance_id": instance_id,
    }  # fmt: skip


def request_bytes(method: str, path: str, body: bytes | None, token: str | None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1"]
    if token:
        lines.append(f"authorization: Bearer {token}")
    if body is not None:
        lines += ["content-type: application/json", f"content-length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


async def _connection(port: int, requests: Iterator[bytes], statuses: dict[int, int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for raw in requests:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head[9:12])
            length = 0
            for line in head.split(b"\r\n"):
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            await reader.readexactly(length)
            statuses[status] = statuses.get(status, 0) + 1
    finally:
        writer.close()


@dataclass
class Row:
    name: str
    num_requests: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    statuses: dict[int, int]


def run_phase(name: str, port: int, pid: int, make: Callable[[int], bytes], n: int, concurrency: int) -> Row:
    shared = iter([make(i) for i in range(n)])  # built before timing
    statuses: dict[int, int] = {}

    async def drive() -> None:
        await asyncio.gather(*(_connection(port, shared, statuses) for _ in range(concurrency)))

    cpu0, srv0, t0 = time.process_time(), proc_cpu_s(pid), time.perf_counter()
    asyncio.run(drive())
    wall, srv1, cpu1 = time.perf_counter() - t0, proc_cpu_s(pid), time.process_time()
    return Row(name, n, wall, srv1 - srv0, cpu1 - cpu0, statuses)


def run_sync_client(name: str, pid: int, n: int, call: Callable[[int], object]) -> Row:
    cpu0, srv0, t0 = time.process_time(), proc_cpu_s(pid), time.perf_counter()
    for i in range(n):
        call(i)
    wall, srv1, cpu1 = time.perf_counter() - t0, proc_cpu_s(pid), time.process_time()
    return Row(name, n, wall, srv1 - srv0, cpu1 - cpu0, {200: n})


def run_registrar_puts(url: str, pid: int, n: int, token: str | None) -> Row:
    async def drive() -> float:
        reg = RankRegistration(rank_ip="127.0.0.1", rank_port=20000, page_size=16, kv_cache_dtype="auto",
                               instance_id="bench", attn_tp_size=TP, prefill_http_port=30000)  # fmt: skip
        registrar = BootstrapRegistrar(url, reg, interval_s=3600, token=token)
        await registrar.start()
        cpu0 = time.process_time()
        for _ in range(n):
            await registrar._put()  # one heartbeat, exactly what the heartbeat task sends
        spent = time.process_time() - cpu0
        await registrar.aclose()
        return spent

    srv0, t0 = proc_cpu_s(pid), time.perf_counter()
    client_cpu = asyncio.run(drive())
    return Row("BootstrapRegistrar heartbeat PUT (1 conn)", n, time.perf_counter() - t0, proc_cpu_s(pid) - srv0,
               client_cpu, {200: n})  # fmt: skip


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=10000, help="requests per row (default %(default)s)")
    p.add_argument("--concurrency", type=int, default=8, help="keep-alive connections (default %(default)s)")
    p.add_argument("--token", action="store_true", help="run the registry with a bearer token")
    args = p.parse_args()
    n, conc = args.requests, args.concurrency
    token = "bench-token" if args.token else None
    port = free_port()
    cmd = [sys.executable, "-m", "bootstrap.cli", "--port", str(port), "--ttl-s", "0", "--max-ranks",
           str(4 * n + 64), "--max-rooms", str(4 * n + 64)]  # fmt: skip
    if token:
        cmd += ["--token", token]
    server = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    headers = {"authorization": f"Bearer {token}"} if token else {}
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=0.5).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)
        for i in range(TP):
            httpx.put(f"{url}/route", json=rank_body(i), headers=headers, timeout=5).raise_for_status()
        for room in range(64):
            httpx.post(f"{url}/register_dp_rank", json={"bootstrap_room": room, "dp_rank": room % 4},
                       headers=headers, timeout=5).raise_for_status()  # fmt: skip
        pid = server.pid
        topo_q = "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
        heartbeats = [json.dumps(rank_body(i)).encode() for i in range(TP)]
        query16 = json.dumps({"bootstrap_rooms": list(range(16))}).encode()
        rows = [
            run_phase("GET /health (floor)", port, pid, lambda i: request_bytes("GET", "/health", None, token),
                      n, conc),
            run_phase("GET /route topology (-1s)", port, pid, lambda i: request_bytes("GET", topo_q, None, token),
                      n, conc),
            run_phase("GET /route concrete rank", port, pid, lambda i: request_bytes(
                "GET", f"/route?prefill_dp_rank=0&prefill_cp_rank=0&target_tp_rank={i % TP}&target_pp_rank=0",
                None, token), n, conc),
            run_phase("PUT /route heartbeat (known rank)", port, pid,
                      lambda i: request_bytes("PUT", "/route", heartbeats[i % TP], token), n, conc),
            run_phase("PUT /route new rank (new instance)", port, pid, lambda i: request_bytes(
                "PUT", "/route", json.dumps(rank_body(0, instance_id=f"new-{i}", tp_size=1)).encode(), token),
                n, conc),
            run_phase("POST /register_dp_rank", port, pid, lambda i: request_bytes(
                "POST", "/register_dp_rank", b'{"bootstrap_room": %d, "dp_rank": 1}' % (1000 + i), token), n, conc),
            run_phase("POST /query_dp_ranks (16 rooms)", port, pid,
                      lambda i: request_bytes("POST", "/query_dp_ranks", query16, token), n, conc),
            run_phase("PUT /route invalid body (400)", port, pid,
                      lambda i: request_bytes("PUT", "/route", b'{"attn_tp_size": "x"}', token), n, conc),
        ]  # fmt: skip
        uncached = BootstrapResolver(token=token, cache_ttl_s=0)
        cached = BootstrapResolver(token=token, cache_ttl_s=3600)
        try:
            rows.append(
                run_sync_client(
                    "BootstrapResolver.resolve uncached (1 conn)",
                    pid,
                    n // 3,
                    lambda i: uncached.resolve("127.0.0.1", port, "bench", tp_rank=i % TP),
                )
            )
            rows.append(
                run_sync_client(
                    "BootstrapResolver.resolve cached",
                    pid,
                    n * 10,
                    lambda i: cached.resolve("127.0.0.1", port, "bench", tp_rank=i % TP),
                )
            )
        finally:
            uncached.close()
            cached.close()
        rows.append(run_registrar_puts(url, pid, n // 3, token))
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    print_table(rows, n, conc, token is not None)


def print_table(rows: list[Row], n: int, conc: int, with_token: bool) -> None:
    floor = rows[0].server_cpu_s / rows[0].num_requests
    print(f"\nbootstrap registry benchmark: {n} requests/row, {conc} keep-alive connections, "
          f"token={'on' if with_token else 'off'}, {os.cpu_count()} CPUs (shared), server CPU from /proc")  # fmt: skip
    header = f"{'route':<44} {'reqs':>6} {'req/s':>9} {'server CPU-µs/req':>18} {'x floor':>8} " \
             f"{'client CPU-µs/req':>18}  statuses"  # fmt: skip
    print(header)
    print("-" * len(header))
    for r in rows:
        server_us = r.server_cpu_s / r.num_requests * 1e6
        ratio = (r.server_cpu_s / r.num_requests) / floor if floor > 0 else float("nan")
        print(f"{r.name:<44} {r.num_requests:>6} {r.num_requests / r.wall_s:>9.0f} {server_us:>18.1f} "
              f"{ratio:>8.2f} {r.client_cpu_s / r.num_requests * 1e6:>18.1f}  {r.statuses}")  # fmt: skip
    print("\nx floor = server CPU per request / that of GET /health. Raw rows: our minimal asyncio client; the")
    print("last three rows are our own clients, one sequential connection (cached resolve: no request at all).")


if __name__ == "__main__":
    main()
