"""KV transfer benchmark: GiB/s per backend for a realistic paged KV, next to a numpy memcpy baseline.

The KV of one 2k-token prompt of a SmolLM2-135M-shaped model (30 layers, 3 KV heads x 64 dims, page size
16, bf16 by default) moves from a prefill KVManager in this process into a decode KVManager in a child
process, in chunks (chunked prefill), through the full control plane. Page lists are fragmented the way
an allocator leaves them after churn. Printed per backend: room throughput (first send -> every write
DONE), per-chunk latency (send -> that chunk's writes DONE), and the same bytes copied with numpy in this
process (block by block, and as one contiguous copy) as the baseline measured in the same run.

    python loadtests/bench_transfer.py                       # tcp and nixl (mooncake needs a netns)
    unshare --net -- sh -c 'ip link set lo up && exec python loadtests/bench_transfer.py'   # + mooncake
    python loadtests/bench_transfer.py --json                # one JSON object per line (below)

``--json`` prints one object per row: ``{"backend", "gib_per_s" (median; null when skipped or failed),
"gib_per_s_min", "gib_per_s_max", "vs_memcpy" (over the ``memcpy`` row: the same blocks copied in one
process), "room_ms", "chunk_p50_ms", "chunk_p99_ms", "blocks_per_chunk", "room_mib", "env", "error"}``.
``shm`` is the same-host path (``transfer.shm``: the decode's pool in ``/dev/shm``, the prefill copies
into it; it reports ``"path"``, what the prefill actually used). Variants: ``nixl`` runs with
``UCX_TLS=tcp`` (the network-like path), ``nixl-ucx-auto`` with ``UCX_TLS`` unset (UCX picks shared
memory / cma on one host), ``nixl-cma`` with ``UCX_TLS=tcp,cma,self`` and ``nixl-posix``
with ``UCX_TLS=tcp,posix,self``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stop_signals import stop_like_ctrl_c

from transfer import (
    KVArgs,
    KVManager,
    KVPoll,
    KVTimeouts,
    TransferBackend,
    TransferError,
    WriteState,
    create_backend,
)
from transfer.base import UNFENCED, Block, Fence, PeerId, Region, WriteHandle
from transfer.blocks import kv_blocks, merge_runs
from transfer.registry import wants_shared_pool
from workers.kv_pool import KVPool

GiB = 1024**3
# bench variants: (backend plugin, environment for both processes; None unsets the variable)
VARIANTS: dict[str, tuple[str, dict[str, str | None]]] = {
    "nixl": ("nixl", {"UCX_TLS": "tcp"}),
    "nixl-ucx-auto": ("nixl", {"UCX_TLS": None}),
    "nixl-cma": ("nixl", {"UCX_TLS": "tcp,cma,self"}),
    "nixl-posix": ("nixl", {"UCX_TLS": "tcp,posix,self"}),
}
DEFAULT_BACKENDS = "shm,tcp,mooncake,nixl,nixl-ucx-auto,nixl-cma,nixl-posix"


def variant(name: str) -> tuple[str, dict[str, str | None]]:
    return VARIANTS.get(name, (name, {}))


class scoped_env:
    """Set (or unset, for None) environment variables for a block; restores them after."""

    def __init__(self, changes: dict[str, str | None]) -> None:
        self.changes = changes
        self.saved: dict[str, str | None] = {}

    def __enter__(self) -> None:
        for key, value in self.changes.items():
            self.saved[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    def __exit__(self, *exc: object) -> None:
        for key, value in self.saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def in_private_netns() -> bool:
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def make_pool(ns: argparse.Namespace, shared: bool = False) -> KVPool:
    return KVPool(num_layers=ns.layers, num_pages=ns.pool_pages, page_size=ns.page_size, num_kv_heads=ns.kv_heads,
                  head_dim=ns.head_dim, dtype=ns.dtype, num_aux_slots=16, aux_slot_bytes=4096, shared=shared)


def fragmented_pages(rng: np.random.Generator, pool_pages: int, n: int) -> list[int]:
    """``n`` distinct page ids in runs of 1-8 consecutive pages, runs in random order."""
    starts = rng.permutation(pool_pages // 8) * 8
    pages: list[int] = []
    for start in starts:
        run = int(rng.integers(1, 9))
        pages.extend(range(int(start), int(start) + min(run, n - len(pages))))
        if len(pages) == n:
            return pages
    raise ValueError("pool too small")


class TimedBackend(TransferBackend):
    """Delegates to a real backend and records, per write, post time and the first time it read DONE."""

    def __init__(self, inner: TransferBackend) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]
        self.posted: dict[WriteHandle, float] = {}
        self.latencies_s: list[float] = []
        self.blocks_per_write: list[int] = []
        self.peer: PeerId = 0
        self.path = inner.name  # the data path the last connect chose (shm: "shm" or its network backend)

    def register(self, regions: Sequence[Region]) -> None:
        self.inner.register(regions)

    def endpoint(self) -> bytes:
        return self.inner.endpoint()

    def connect(self, endpoint: bytes) -> PeerId:
        peer = self.inner.connect(endpoint)
        self.peer = peer
        path_of = getattr(self.inner, "path_of", None)
        self.path = path_of(peer) if path_of is not None else self.inner.name
        return peer

    def write(self, peer: PeerId, blocks: Sequence[Block], fence: Fence = UNFENCED) -> WriteHandle:
        handle = self.inner.write(peer, blocks, fence)
        self.posted[handle] = time.perf_counter()
        self.blocks_per_write.append(len(blocks))
        return handle

    def poll(self, handle: WriteHandle) -> WriteState:
        state = self.inner.poll(handle)
        if state == WriteState.DONE and handle in self.posted:
            self.latencies_s.append(time.perf_counter() - self.posted.pop(handle))
        return state

    def error(self, handle: WriteHandle) -> TransferError | None:
        return self.inner.error(handle)

    def release(self, handle: WriteHandle) -> None:
        self.posted.pop(handle, None)
        self.inner.release(handle)

    def probe(self, peer: PeerId) -> bool:
        return self.inner.probe(peer)

    def disconnect(self, peer: PeerId) -> None:
        self.inner.disconnect(peer)

    def close(self) -> None:
        self.inner.close()


# -- child: the decode -----------------------------------------------------------------------------
def child_main(ns: argparse.Namespace) -> None:
    pool = make_pool(ns, shared=wants_shared_pool(ns.backend))  # shm: the decode's pool in /dev/shm
    manager = KVManager("decode", KVArgs.from_pool(pool), create_backend(ns.backend))
    out = os.fdopen(ns.reply_fd, "wb", buffering=0)
    out.write(b'"ready"\n')
    for line in os.fdopen(ns.cmd_fd, "rb"):
        cmd = msgspec.json.decode(line)
        if cmd["op"] == "quit":
            break
        receiver = manager.create_receiver(cmd["room"], cmd["host"], cmd["port"])
        while receiver.poll() == KVPoll.Bootstrapping:
            time.sleep(0.0005)
        receiver.send_metadata(cmd["pages"], 0)
        while receiver.poll() not in (KVPoll.Success, KVPoll.Failed):
            time.sleep(0.0005)
        error = receiver.failure()
        receiver.release()
        out.write(msgspec.json.encode({"ok": error is None, "error": str(error) if error else None}) + b"\n")
    manager.close()
    pool.close()


# -- parent: the prefill ---------------------------------------------------------------------------
def spawn_decode(ns: argparse.Namespace, backend: str) -> tuple[subprocess.Popen[bytes], Any, Any]:
    cmd_r, cmd_w = os.pipe()
    reply_r, reply_w = os.pipe()
    argv = [sys.executable, __file__, "--child", f"--backend={backend}", f"--cmd-fd={cmd_r}", f"--reply-fd={reply_w}",
            *shape_argv(ns)]
    proc = subprocess.Popen(argv, pass_fds=(cmd_r, reply_w), stdout=subprocess.DEVNULL)
    os.close(cmd_r)
    os.close(reply_w)
    cmd, reply = os.fdopen(cmd_w, "wb", buffering=0), os.fdopen(reply_r, "rb")
    if msgspec.json.decode(reply.readline()) != "ready":
        raise RuntimeError("decode child failed to start")
    return proc, cmd, reply


def shape_argv(ns: argparse.Namespace) -> list[str]:
    return [f"--layers={ns.layers}", f"--kv-heads={ns.kv_heads}", f"--head-dim={ns.head_dim}",
            f"--page-size={ns.page_size}", f"--dtype={ns.dtype}", f"--pool-pages={ns.pool_pages}",
            f"--tokens={ns.tokens}"]


def bench_backend(ns: argparse.Namespace, row_name: str, pool: KVPool) -> dict[str, Any]:
    backend_name, env = variant(row_name)
    with scoped_env(env):
        return _bench_backend(ns, backend_name, pool)


def wait_warm(timed: TimedBackend, limit_s: float = 120.0) -> float:
    """Steady state before measuring: wait while the backend still pre-faults its mapping of the decode's
    pool (``shm``: first touches of pages cost page faults until then). Returns the seconds waited."""
    is_warm = getattr(timed.inner, "is_warm", None)
    started = time.perf_counter()
    while is_warm is not None and not is_warm(timed.peer) and time.perf_counter() - started < limit_s:
        time.sleep(0.01)
    return time.perf_counter() - started


def _bench_backend(ns: argparse.Namespace, backend_name: str, pool: KVPool) -> dict[str, Any]:
    timed = TimedBackend(create_backend(backend_name))
    manager = KVManager("prefill", KVArgs.from_pool(pool), timed, timeouts=KVTimeouts(transfer_s=120.0))
    proc, cmd, reply = spawn_decode(ns, backend_name)
    host, port = manager.control_address
    rng = np.random.default_rng(1)
    n_pages = ns.tokens // ns.page_size
    chunk_pages = ns.chunk_tokens // ns.page_size
    room_s: list[float] = []
    warm_wait_s = 0.0
    try:
        for i in range(ns.warmup + ns.rooms):
            src = fragmented_pages(rng, ns.pool_pages, n_pages)
            dst = fragmented_pages(rng, ns.pool_pages, n_pages)
            sender = manager.create_sender(i)
            cmd.write(msgspec.json.encode({"op": "room", "room": i, "host": host, "port": port, "pages": dst}) + b"\n")
            while sender.poll() == KVPoll.Bootstrapping:
                time.sleep(0.0002)
            if i == ns.warmup:
                warm_wait_s = wait_warm(timed)
                timed.latencies_s.clear()
                timed.blocks_per_write.clear()
            started = time.perf_counter()
            for offset in range(0, n_pages, chunk_pages):
                last = offset + chunk_pages >= n_pages
                sender.send(src[offset : offset + chunk_pages], last=last, aux=b"tok" if last else None)
            while sender.poll() not in (KVPoll.Success, KVPoll.Failed):
                time.sleep(0.0002)
            elapsed = time.perf_counter() - started
            if sender.poll() != KVPoll.Success:
                raise RuntimeError(f"{backend_name}: room {i} failed: {sender.failure()}")
            sender.release()
            result = msgspec.json.decode(reply.readline())
            if not result["ok"]:
                raise RuntimeError(f"{backend_name}: decode side of room {i} failed: {result['error']}")
            if i >= ns.warmup:
                room_s.append(elapsed)
        cmd.write(b'{"op": "quit"}\n')
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        manager.close()
    room_bytes = n_pages * len(pool.kv_ptrs()) * pool.page_bytes
    lat_ms = sorted(1000 * s for s in timed.latencies_s)
    return {
        "backend": backend_name,
        "gibps": [room_bytes / s / GiB for s in room_s],
        "room_ms": statistics.median(room_s) * 1000,
        "chunk_p50_ms": lat_ms[len(lat_ms) // 2],
        "chunk_p99_ms": lat_ms[min(len(lat_ms) - 1, int(len(lat_ms) * 0.99))],
        "blocks_per_chunk": statistics.median(timed.blocks_per_write),
        "path": timed.path,
        "warm_wait_s": warm_wait_s,
    }


def bench_memcpy(ns: argparse.Namespace, src_pool: KVPool) -> list[tuple[str, list[float]]]:
    """The same bytes copied in this process with numpy: block by block (same fragmentation) and
    as one contiguous buffer."""
    dst_pool = make_pool(ns)
    rng = np.random.default_rng(1)
    n_pages = ns.tokens // ns.page_size
    src_mem = [b.view(np.uint8).reshape(-1) for b in src_pool.kv_buffers()]
    dst_mem = [b.view(np.uint8).reshape(-1) for b in dst_pool.kv_buffers()]
    item = src_pool.page_bytes
    total = n_pages * len(src_mem) * item
    blockwise, contiguous = [], []
    flat_src, flat_dst = np.ones(total, np.uint8), np.zeros(total, np.uint8)
    for _ in range(ns.warmup + ns.rooms):
        src = fragmented_pages(rng, ns.pool_pages, n_pages)
        dst = fragmented_pages(rng, ns.pool_pages, n_pages)
        runs = merge_runs(src, dst)
        blocks = kv_blocks([0] * len(src_mem), [0] * len(dst_mem), [item] * len(src_mem), runs)
        started = time.perf_counter()
        for b in range(len(src_mem)):
            per_buf = blocks[b * len(runs) : (b + 1) * len(runs)]
            for s, d, n in per_buf:
                dst_mem[b][d : d + n] = src_mem[b][s : s + n]
        blockwise.append(total / (time.perf_counter() - started) / GiB)
        started = time.perf_counter()
        np.copyto(flat_dst, flat_src)
        contiguous.append(total / (time.perf_counter() - started) / GiB)
    return [("memcpy", blockwise[ns.warmup :]), ("memcpy-contiguous", contiguous[ns.warmup :])]


def main() -> None:
    stop_like_ctrl_c()  # SIGTERM, SIGHUP: the servers are stopped in ``finally``, as on Ctrl-C
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", default=DEFAULT_BACKENDS,
                        help=f"comma-separated backends or variants (default {DEFAULT_BACKENDS})")
    parser.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk-tokens", type=int, default=512)
    parser.add_argument("--pool-pages", type=int, default=1024)
    parser.add_argument("--rooms", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", help=argparse.SUPPRESS)
    parser.add_argument("--cmd-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--reply-fd", type=int, help=argparse.SUPPRESS)
    ns = parser.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    os.environ.setdefault("UCX_TLS", "tcp")
    if not in_private_netns():
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
    if ns.child:
        child_main(ns)
        return
    pool = make_pool(ns)
    for buf in pool.kv_buffers():
        buf.view(np.uint8)[...] = np.random.default_rng(0).integers(0, 256, buf.nbytes, np.uint8).reshape(
            buf.view(np.uint8).shape)
    n_pages = ns.tokens // ns.page_size
    room_mib = n_pages * 2 * ns.layers * pool.page_bytes / 2**20
    print(f"KV of a {ns.tokens}-token prompt: {ns.layers} layers x (K,V) x {n_pages} pages of {pool.page_bytes} B "
          f"({ns.kv_heads} heads x {ns.head_dim} x {ns.page_size} tok, {ns.dtype}) = {room_mib:.1f} MiB per room; "
          f"chunks of {ns.chunk_tokens} tokens; {ns.rooms} rooms (+{ns.warmup} warm-up); "
          f"cpus={os.cpu_count()}", file=sys.stderr if ns.json else sys.stdout)
    results: list[dict[str, Any]] = []
    for name in ns.backends.split(","):
        backend_name, env = variant(name)
        row: dict[str, Any] = {"backend": name, "gib_per_s": None, "room_mib": round(room_mib, 2),
                               "env": {k: v for k, v in env.items()}}
        results.append(row)
        if backend_name == "mooncake" and not in_private_netns():
            row["error"] = "skipped: run under unshare --net (Mooncake binds 0.0.0.0)"
            continue
        try:
            r = bench_backend(ns, name, pool)
        except (TransferError, RuntimeError, ValueError) as exc:
            row["error"] = f"failed: {exc}"
            continue
        g = r["gibps"]
        row.update(gib_per_s=statistics.median(g), gib_per_s_min=min(g), gib_per_s_max=max(g),
                   room_ms=r["room_ms"], chunk_p50_ms=r["chunk_p50_ms"], chunk_p99_ms=r["chunk_p99_ms"],
                   blocks_per_chunk=r["blocks_per_chunk"], path=r["path"], warm_wait_s=r["warm_wait_s"])
    memcpy_rows = []
    for label, g in bench_memcpy(ns, pool):
        memcpy_rows.append({"backend": label, "gib_per_s": statistics.median(g), "gib_per_s_min": min(g),
                            "gib_per_s_max": max(g), "room_mib": round(room_mib, 2),
                            "room_ms": room_mib / 1024 / statistics.median(g) * 1000})
    baseline = memcpy_rows[0]["gib_per_s"]
    for row in [*results, *memcpy_rows]:
        if row["gib_per_s"] is not None:
            row["vs_memcpy"] = row["gib_per_s"] / baseline
    if ns.json:
        for row in [*results, *memcpy_rows]:
            print(msgspec.json.encode({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}).decode(),
                  flush=True)
        return
    table: list[tuple[str, ...]] = []
    for row in [*results, *memcpy_rows]:
        if row["gib_per_s"] is None:
            table.append((row["backend"], row.get("error", ""), "", "", "", "", ""))
            continue
        chunk = (f"{row['chunk_p50_ms']:.1f}", f"{row['chunk_p99_ms']:.1f}", f"{row['blocks_per_chunk']:.0f}") \
            if "chunk_p50_ms" in row else ("", "", "")
        table.append((row["backend"], f"{row['gib_per_s']:.2f} ({row['gib_per_s_min']:.2f}-{row['gib_per_s_max']:.2f})",
                      f"{row['vs_memcpy']:.2f}", f"{row['room_ms']:.1f}", *chunk))
    header = ("path", "GiB/s median (min-max)", "x memcpy", "room ms", "chunk p50 ms", "chunk p99 ms", "blocks/chunk")
    widths = [max(len(r[i]) for r in [header, *table]) for i in range(len(header))]
    for cells in [header, tuple("-" * w for w in widths), *table]:
        print(" | ".join(cell.ljust(w) for cell, w in zip(cells, widths, strict=True)))

if __name__ == "__main__":
    main()
