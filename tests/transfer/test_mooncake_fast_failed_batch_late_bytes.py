"""A Mooncake batch the engine fails quickly (not its MC_TRANSFER_TIMEOUT) may still have slices in flight: the
engine answers -1 as soon as one slice failed, while the others go on. Measured with 0.3.13.post1 over tcp: a batch
of more than 1024 entries (``max_batch_blocks`` up to ``max_inflight_blocks``, 2048 by default) to a decode that
stalls for over a second fails after 1 s (the tcp lanes' admission timeout, ``MC_TCP_ADMISSION_TIMEOUT_MS``), and
the slices the lanes had in hand land once the decode runs again. The decode, which does not fence Mooncake's
writes, takes the end of the room's writes (the prefill's ``Quiesced``) as leave to give its pages out again: no
byte of a write may land after the write ended, failed or not.

Real engines, the decode in a child process (frozen with SIGSTOP, its KV memory shared with the test), in a network
namespace of its own (Mooncake binds 0.0.0.0).
"""

from __future__ import annotations

import textwrap

import pytest
from kvunit import run_mooncake_child

_CHILD = textwrap.dedent("""
    import ctypes, mmap, os, signal, time
    from transfer import WriteState

    N, BLOCK = 2048, 2048  # small KV blocks (page_size 1): one 4 MiB turn is one engine call of 2048 entries
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
    try:
        prefill.register([(ctypes.addressof(src), SIZE)])
        peer = prefill.connect(endpoint)
        os.kill(pid, signal.SIGSTOP)  # the decode stalls (a starved host) for 2.5 s
        started = time.monotonic()
        handle = prefill.write(peer, [(ctypes.addressof(src) + i * BLOCK, ctypes.addressof(dst) + i * BLOCK, BLOCK)
                                      for i in range(N)])
        ended, resumed = None, False
        while ended is None and time.monotonic() - started < 90:
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
        prefill.close()
""")


@pytest.mark.slow
def test_no_byte_of_a_quickly_failed_batch_lands_after_its_write_ended() -> None:
    run_mooncake_child(_CHILD, timeout_s=150.0)
