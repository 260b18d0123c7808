"""A decode's ``pd_worker_kv_transfer_bytes_total{direction="received"}`` counts the KV of every room that landed
(``pd_worker_kv_transfer_rooms_total{outcome="completed"}``), also of a request that ended while it waited for a
batch slot (stage imported: its KV and first token here, ``--max-running`` sequences decoding): the prefill's
``sent`` counted those bytes, and they were moved."""

from __future__ import annotations

import time

from transfer import KVArgs, KVManager, create_backend
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import BootstrapTarget, SamplingParams, Submit
from workers.scheduler import Scheduler, SchedulerConfig


def test_kv_bytes_received_include_rooms_of_requests_aborted_while_imported() -> None:
    sides = []
    for role in ("prefill", "decode"):
        engine = SimEngine()
        info = engine.info
        pool = KVPool(num_layers=info.num_layers, num_pages=256, page_size=4, num_kv_heads=info.num_kv_heads,
                      head_dim=info.head_dim)
        engine.bind(pool)
        kv = KVManager(role, KVArgs.from_pool(pool), create_backend("tcp"))
        sched = Scheduler(SchedulerConfig(role, chunk_size=64, max_running=2 if role == "decode" else 64), engine,
                          pool, lambda msgs: None, kv)
        sched.connect(1)
        sides.append((sched, kv))
    (p, pkv), (d, dkv) = sides
    try:
        host, port = pkv.control_address
        for rid in range(1, 7):
            target = BootstrapTarget(host, port, 100 + rid)
            for sched in (d, p):
                sched.submit(1, Submit(rid, [rid * 20 + i for i in range(9)], SamplingParams(max_new_tokens=8),
                                       target, timeout_s=60))
        aborted = 0
        deadline = time.monotonic() + 30
        p.step()  # (admitted: the loop below runs while either side holds requests)
        d.step()
        while d.reqs or p.reqs:
            assert time.monotonic() < deadline, {k: r.stage for k, r in d.reqs.items()}
            p.step()
            d.step()
            for req in [r for r in d.reqs.values() if r.stage == "imported"]:
                d.abort(1, req.rid, "client left")  # its KV landed; it never joined the batch
                aborted += 1
            time.sleep(0.001)
        for _ in range(20):
            p.step()
            d.step()
        assert aborted > 0
        completed = dkv.counters.num_rooms_completed
        assert completed == pkv.counters.num_rooms_completed == 6
        sent = pkv.counters.num_bytes_sent
        assert d.metrics.kv_bytes_received == sent, (
            f"decode counted {d.metrics.kv_bytes_received} bytes received of the {sent} the prefill sent "
            f"({completed} rooms completed, {aborted} of their requests aborted while imported)")
    finally:
        pkv.close()
        dkv.close()
