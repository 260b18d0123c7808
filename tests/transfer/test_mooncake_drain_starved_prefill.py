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

import pytest
from kvunit import late_bytes_child, run_mooncake_child

_CHILD = late_bytes_child(
    deadline_s=75.0,
    before="""
        CPU = "/sys/fs/cgroup/cpu"
        if os.geteuid() != 0 or not os.path.isfile(os.path.join(CPU, "cpu.cfs_quota_us")):
            print("SKIP: needs root and a cgroup v1 cpu controller at " + CPU)
            raise SystemExit(0)
        group = os.path.join(CPU, f"pd-gateway-starved-{os.getpid()}")
        os.mkdir(group)
    """,
    after_connect="""
        for name, value in (("cpu.cfs_period_us", 100000), ("cpu.cfs_quota_us", 3000)):  # 3% of a CPU
            with open(os.path.join(group, name), "w") as f:
                f.write(str(value))
        for member in (os.getpid(), pid):  # (the whole process, every thread of the engine)
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(member))
    """,
    cleanup="""
        with open(os.path.join(CPU, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
        os.rmdir(group)
    """,
)


@pytest.mark.slow
def test_a_failed_batch_drains_to_its_end_on_a_starved_prefill() -> None:
    run_mooncake_child(_CHILD, timeout_s=150.0)
