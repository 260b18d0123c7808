"""A decode request ended while its KV could still land waits in quarantine; once quiesced its pages go back to the
pool, and the gateway must be told promptly (a ``LoadReport`` at the next report interval), not half a second later
at the idle heartbeat: until then the gateway still counts those pages as taken and the room as an inflight transfer."""

from __future__ import annotations

import time

import pytest

from tests.workers.test_scheduler import _pd_pair
from workers.protocol import BootstrapTarget, LoadReport, SamplingParams, Submit
from workers.scheduler import IDLE_REPORT_S, REPORT_MIN_INTERVAL_S


def test_pages_freed_from_quarantine_are_reported_at_once() -> None:
    pytest.importorskip("mooncake.engine")
    # (mooncake: its decode learns from the prefill that no write of an ended room is left, ``Quiesced``; tcp
    # fences writes itself and frees the pages at the abort)
    (p, _, pkv), (d, dsink, dkv) = _pd_pair(64, 64, backend="mooncake")
    try:
        host, port = pkv.control_address
        target = BootstrapTarget(host, port, 4242)
        params = SamplingParams(max_new_tokens=8)
        p.submit(1, Submit(1, list(range(9)), params, target, timeout_s=60))
        p.step()  # admitted: its sender waits for the page list (the prefill is not stepped again until the abort)
        d.submit(1, Submit(1, list(range(9)), params, target, timeout_s=60))
        deadline = time.monotonic() + 10
        while not (d.reqs and next(iter(d.reqs.values())).stage == "transfer"):  # its page list sent, nothing written
            assert time.monotonic() < deadline, "the decode never sent its page list"
            d.step()
            time.sleep(0.002)
        d.abort(1, 1, "the client left")
        d.step()
        assert len(d.quarantine) == 1 and d.cache.num_available < d.pool.num_pages
        while len(d.quarantine):
            assert time.monotonic() < deadline, "the aborted room never quiesced"
            p.step()
            seen = len(dsink.items)  # (the step that frees the pages may report them itself)
            d.step()
            time.sleep(0.001)
        freed_at = time.monotonic()
        assert d.cache.num_available == d.pool.num_pages
        while time.monotonic() < freed_at + 20 * REPORT_MIN_INTERVAL_S:
            d.step()
            time.sleep(0.001)
        reports = [m for _, m in dsink.items[seen:] if isinstance(m, LoadReport)]
        assert 20 * REPORT_MIN_INTERVAL_S < IDLE_REPORT_S / 4
        assert reports, "no load report after the quarantined pages went back to the pool"
        assert reports[-1].num_free_pages == d.pool.num_pages and reports[-1].num_inflight_transfers == 0
    finally:
        pkv.close()
        dkv.close()
