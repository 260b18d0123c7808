"""A failed Mooncake batch's drain must end on a starved prefill too. The drain re-sends the batch's first entries
until a re-send completes (``MooncakeBackend._drain``); re-sending the engine's whole queue (1024 entries) each time,
it never completed on a prefill held to a few percent of a CPU (a loaded CI host: "the write never ended" within
90 s): each re-send waited for admission behind what the last one had left queued, which the starved engine did not
move within its admission timeout (1 s); later ones were refused at once, the admission queue full of its own
copies, while the connections sat idle.

The test of ``test_mooncake_fast_failed_batch_late_bytes`` with both processes in a cgroup (v1 ``cpu``, root) held
to 3% of a CPU from the freeze on: the write must end within 75 s (it took 18 s; 29 s at 2%), and no byte of it
land afterwards.
"""

from __future__ import annotations

import textwrap

import pytest
from kvunit import run_mooncake_child

_CHILD = textwrap.dedent("""
    import ctypes, mmap, os, signal, time
    from transfer import WriteState

    CPU = "/sys/fs/cgroup/cpu"
    if os.geteuid() != 0 or not os.path.isfile(os.path.join(CPU, "cpu.cfs_quota_us")):
        print("SKIP: needs root and a cgroup v1 cpu controller at " + CPU)
        raise SystemExit(0)
    group = os.path.join(CPU, f"pd-gateway-starved-{os.getpid()}")

    N, BLOCK = 2048, 2048  # small KV blocks: one 4 MiB turn is one engine call of 2048 entries
    SIZE = N * BLOCK
    shared = mmap.mmap(-1, SIZE)  # the decode's KV memory, seen by this process too
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the decode
        from transfer.mooncake import MooncakeBackend
        decode = MooncakeBackend()
        decode.register([(ctypes.addressof((ctypes.c_ubyte * SIZE).from_buffer(shared)), SIZE)])
        endpoint = decode.endpoint()
        os.write(ready_w, len(endpoint).to_bytes(4, "big") + endpoint)
        while True:
            time.sleep(1)
    from transfer.mooncake import MooncakeBackend
    size = int.from_bytes(os.read(ready_r, 4), "big")
    endpoint = b""
    while len(endpoint) < size:
        endpoint += os.read(ready_r, size - len(endpoint))
    dst = (ctypes.c_ubyte * SIZE).from_buffer(shared)
    src = (ctypes.c_ubyte * SIZE)()
    ctypes.memset(src, 0x5A, SIZE)
    prefill = MooncakeBackend(options={"max_batch_blocks": "2048"})
    os.mkdir(group)
    try:
        prefill.register([(ctypes.addressof(src), SIZE)])
        peer = prefill.connect(endpoint)
        for name, value in (("cpu.cfs_period_us", 100000), ("cpu.cfs_quota_us", 3000)):  # 3% of a CPU
            with open(os.path.join(group, name), "w") as f:
                f.write(str(value))
        for member in (os.getpid(), pid):  # (the whole process, every thread of the engine)
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(member))
        os.kill(pid, signal.SIGSTOP)  # the decode stalls for 2.5 s
        started = time.monotonic()
        handle = prefill.write(peer, [(ctypes.addressof(src) + i * BLOCK, ctypes.addressof(dst) + i * BLOCK, BLOCK)
                                      for i in range(N)])
        ended, resumed = None, False
        while ended is None and time.monotonic() - started < 75:
            if not resumed and time.monotonic() - started > 2.5:
                os.kill(pid, signal.SIGCONT)
                resumed = True
            if prefill.poll(handle) != WriteState.PENDING:
                ended = time.monotonic()
            time.sleep(0.01)
        assert ended is not None, "the write never ended"
        ctypes.memset(ctypes.addressof(dst), 0, SIZE)  # its room quiesced: the decode gives the pages out again
        while time.monotonic() < max(started + 10.0, ended + 5.0):
            if not resumed and time.monotonic() - started > 2.5:
                os.kill(pid, signal.SIGCONT)
                resumed = True
            landed = sum(1 for i in range(N) if dst[i * BLOCK])
            assert not landed, (f"{landed} blocks landed {time.monotonic() - ended:.1f}s after the write ended "
                                f"{prefill.poll(handle).name} ({ended - started:.1f}s after it began: "
                                f"{prefill.error(handle)})")
            time.sleep(0.05)
        print("ok")
    finally:
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        with open(os.path.join(CPU, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        prefill.close()
        os.rmdir(group)
""")


@pytest.mark.slow
def test_a_failed_batch_drains_to_its_end_on_a_starved_prefill() -> None:
    run_mooncake_child(_CHILD, timeout_s=150.0)
