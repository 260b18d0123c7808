"""The worker's busy fraction (``pd_worker_busy_ratio``, ``/load``, SGLang's ``/v1/loads`` utilization) is the share
of *recent* time its engine computed: once the load is over it falls back towards 0, whether or not a gateway is
still connected (a gateway restarted, or one that took the worker out of its fleet, leaves it with none)."""

from __future__ import annotations

import time

from workers.engines.base import EngineOptions
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig


def test_busy_fraction_falls_back_once_idle_after_the_gateway_left() -> None:
    engine = SimEngine(EngineOptions(extra={"decode_step_s": "0.01"}))
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=64, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    sched = Scheduler(SchedulerConfig("both", chunk_size=64, max_running=8), engine, pool, lambda msgs: None)
    sched.start()
    try:
        sched.connect(1)
        for rid in range(1, 5):
            sched.submit(1, Submit(rid, [10 + rid, 20, 30], SamplingParams(max_new_tokens=80, ignore_eos=True)))
        deadline = time.monotonic() + 30
        while sched.reqs or sched.num_steps == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        busy = sched.busy_fraction
        assert busy > 0.5, busy  # ~1 s of back-to-back decode steps
        sched.drop_connection(1)  # the gateway went away; the worker is idle from now on
        time.sleep(3.0)  # three averaging windows (BUSY_WINDOW_S) of an idle engine
        assert sched.busy_fraction < 0.1, f"busy fraction still {sched.busy_fraction} after 3 s idle (was {busy})"
    finally:
        sched.stop()
