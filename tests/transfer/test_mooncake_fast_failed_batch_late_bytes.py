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

import pytest
from kvunit import late_bytes_child, run_mooncake_child

_CHILD = late_bytes_child(deadline_s=90.0)


@pytest.mark.slow
def test_no_byte_of_a_quickly_failed_batch_lands_after_its_write_ended() -> None:
    run_mooncake_child(_CHILD, timeout_s=150.0)
