"""The worker's probes: ``/health`` is readiness (200 only once serving), ``/liveness`` stays 200 while
the worker starts (a prefill retrying its registration must not be killed for it) and turns 503 only
when the scheduler has died. The integration side is ``test_worker_startup.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from starlette.testclient import TestClient

from workers.http_app import create_http_app


def client(started: bool, scheduler_alive: bool | None, registration_error: str | None = None,
           stalled_s: float = 0.0, stopping: bool = False) -> TestClient:
    scheduler = None if scheduler_alive is None else SimpleNamespace(is_alive=scheduler_alive, stalled_s=stalled_s)
    worker = SimpleNamespace(worker_id="p", started=started, scheduler=scheduler, kv=None, sglang=None,
                             registration_error=registration_error, stopping=stopping,
                             config=SimpleNamespace(role="prefill", engine="sim", transfer="tcp", api_key=None,
                                                    watchdog_timeout_s=300.0))
    return TestClient(create_http_app(worker))  # type: ignore[arg-type]


@pytest.mark.parametrize(("started", "alive", "status", "health", "liveness"), [
    (False, None, "starting", 503, 200),  # before the engine is up
    (False, True, "starting", 503, 200),  # scheduler running, still registering
    (True, True, "ok", 200, 200),
    (True, False, "unhealthy", 503, 503),  # the scheduler thread died
    (False, False, "unhealthy", 503, 503),  # ... while the worker was still starting (registering)
])
def test_health_is_readiness_and_liveness_only_fails_on_a_dead_scheduler(
        started: bool, alive: bool | None, status: str, health: int, liveness: int) -> None:
    with client(started, alive) as c:
        for path, code in (("/health", health), ("/liveness", liveness)):
            reply = c.get(path)
            assert (reply.status_code, reply.json()) == (code, {"status": status, "role": "prefill"}), path


def test_a_stopping_worker_is_not_ready_but_alive() -> None:
    """From SIGTERM on (``Worker.aclose`` begun: deregistering, draining its connections), ``/health`` is a 503: an
    SGLang router probing it stops sending requests there before its listener closes (a second or more with a
    slow registry), rather than sending them to be refused."""
    for alive in (True, False):  # (its scheduler stops on the way out: no death for a liveness probe to act on)
        with client(True, alive, stopping=True) as c:
            reply = c.get("/health")
            assert (reply.status_code, reply.json()["status"]) == (503, "stopping")
            assert c.get("/liveness").status_code == 200


def test_a_lapsed_registration_is_not_ready_but_alive() -> None:
    with client(True, True, "3 registry renewals failed in a row: HTTP 503") as c:
        reply = c.get("/health")
        assert reply.status_code == 503 and reply.json()["status"] == "unregistered"
        assert "renewals failed" in reply.json()["error"]
        assert c.get("/liveness").status_code == 200


def test_a_registration_is_lapsed_after_three_failed_renewals_or_a_lease_without_one() -> None:
    """A registry that times out makes each failed renewal last seconds: the entry lapses (10 s lease) long
    before three of them have failed."""
    import time
    from types import SimpleNamespace

    from workers.worker import DEFAULT_LEASE_S, Worker

    worker = Worker.__new__(Worker)
    now = time.monotonic()
    for failures, since_ok, lapsed in ((0, 60.0, False), (1, 1.0, False), (2, DEFAULT_LEASE_S - 1, False),
                                       (3, 1.0, True), (1, DEFAULT_LEASE_S + 1, True)):
        worker._registrar = SimpleNamespace(num_failures=failures, last_success=now - since_ok,  # type: ignore[assignment]
                                            last_error="ReadTimeout")
        assert (worker.registration_error is not None) is lapsed, (failures, since_ok)


def test_an_embedded_registry_on_port_0_reports_the_port_it_got() -> None:
    """(``/server_info``'s ``disaggregation_bootstrap_port`` said 0: SGLang's router would use that.)"""
    from types import SimpleNamespace

    from workers.config import WorkerConfig
    from workers.worker import Worker

    worker = Worker.__new__(Worker)
    worker.config = WorkerConfig(role="prefill", bootstrap_embedded=0)
    worker._embedded = SimpleNamespace(port=43210)
    assert worker.embedded_registry_port == 43210
    worker._embedded = None
    assert worker.embedded_registry_port == 0


@pytest.mark.parametrize(("stalled_s", "liveness"), [(0.0, 200), (299.0, 200), (301.0, 503)])
def test_liveness_fails_once_a_forward_has_hung_past_the_watchdog(stalled_s: float, liveness: int) -> None:
    """A scheduler holding requests that has not finished a step for ``--watchdog-timeout-s`` (a hung GPU kernel)
    is alive in name only: /liveness says so, so that the orchestrator (or pd-cluster) restarts the worker."""
    with client(True, True, stalled_s=stalled_s) as c:
        reply = c.get("/liveness")
        assert reply.status_code == liveness
        assert (reply.json()["status"] == "stalled") is (liveness == 503)
