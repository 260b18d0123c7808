"""A Mooncake batch that the engine timed out (``MC_TRANSFER_TIMEOUT``) on a black-holed path: once a re-send of it
completes, its write ends, and the decode gives the pages out again. The timed-out batch's bytes sit on a
connection of their own whose retransmissions backed off while the path was dark: they land when its next
retransmission fires, which may be well after a re-send on a fresh connection completed. So a completed re-send is
not the end of the timed-out batch: no byte of a write may land once the write has ended (measured with
0.3.13.post1 over tcp: the whole batch landed 7 s after the write ended).

Real engines in one child process, in a network namespace of its own whose loopback ``iptables`` black-holes
(root): nothing else's loopback goes dark meanwhile (the suite's own namespace is shared by its long-lived servers).
"""

from __future__ import annotations

import textwrap

import pytest
from kvunit import run_mooncake_child

_CHILD = textwrap.dedent("""
    import ctypes, os, subprocess, sys, time
    from transfer import WriteState
    from transfer.mooncake import MooncakeBackend

    RULE = ["INPUT", "-i", "lo", "-p", "tcp", "-j", "DROP"]
    N, BLOCK = 64, 256 << 10

    def iptables(op):
        try:
            return subprocess.run(["iptables", op, *RULE], capture_output=True, timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False

    os.environ["MC_TRANSFER_TIMEOUT"] = "5"  # (the least Mooncake takes; 30 s by default)
    src, dst = (ctypes.c_ubyte * (N * BLOCK))(), (ctypes.c_ubyte * (N * BLOCK))()
    ctypes.memset(src, 0x5A, N * BLOCK)
    prefill, decode = MooncakeBackend(), MooncakeBackend()
    try:
        prefill.register([(ctypes.addressof(src), N * BLOCK)])
        decode.register([(ctypes.addressof(dst), N * BLOCK)])
        peer = prefill.connect(decode.endpoint())
        if not iptables("-A"):
            print("SKIP: cannot black-hole loopback with iptables here"); sys.exit(0)
        started = time.monotonic()
        handle = prefill.write(peer, [(ctypes.addressof(src) + i * BLOCK, ctypes.addressof(dst) + i * BLOCK, BLOCK)
                                      for i in range(N)])
        ended, cleared = None, False
        while ended is None and time.monotonic() - started < 120:
            if not cleared and time.monotonic() - started > 13.5:  # (past two of the engine's timeouts)
                cleared = iptables("-D")
                assert cleared
            if prefill.poll(handle) != WriteState.PENDING:
                ended = time.monotonic()
            time.sleep(0.02)
        assert ended is not None and cleared, "the write never ended"
        ctypes.memset(dst, 0, N * BLOCK)  # its room quiesced: the decode gives the pages out again
        while time.monotonic() < max(started + 40.0, ended + 5.0):
            landed = sum(1 for i in range(N) if dst[i * BLOCK])
            assert not landed, (f"{landed} blocks landed {time.monotonic() - ended:.1f}s after the write ended "
                                f"({ended - started:.1f}s after it began)")
            time.sleep(0.05)
        print("ok")
    finally:
        prefill.close()
        decode.close()
""")


@pytest.mark.slow
def test_no_byte_of_a_timed_out_batch_lands_after_its_write_ended() -> None:
    run_mooncake_child(_CHILD, tools=("iptables",), timeout_s=180.0)
