"""An SGLang decode whose half-open breaker has its trials in flight keeps the gateway ready, as a native one does.

While half-open, a worker takes at most ``breaker_successes`` trial requests at a time: it leaves selection
until one of them answers, and is back at once after. The native dispatcher's readiness counts such a worker
(``WorkerClient.available``: its trials must not flap ``/readiness``); the SGLang fleet's read ``healthy``, so a
gateway over SGLang workers answered ``/readiness`` 503 for as long as a recovering decode's trials ran (a
load balancer took the gateway out of service just as its decode came back).
"""

from __future__ import annotations

from gateway.health import BreakerState, HealthConfig
from gateway.runtime import Gateway, GatewayConfig


def test_a_half_open_sglang_decode_with_its_trials_in_flight_keeps_the_gateway_ready() -> None:
    gw = Gateway(GatewayConfig(prefill=("http://127.0.0.1:1",), prefill_bootstrap_ports=(None,),
                               decode=("http://127.0.0.1:2",), health=HealthConfig(breaker_cooldown_s=1e-9)))
    fleet = gw.fleet
    assert fleet is not None
    for worker in fleet.workers:
        worker.is_up = True  # (passing its probes)
    assert gw.is_ready() and gw.serves()
    decode = fleet.decodes[0]
    breaker = decode.health.breaker
    for _ in range(breaker.failures_to_open):
        breaker.record_failure()
    assert breaker.state is BreakerState.HALF_OPEN
    rids = [decode.opened(), decode.opened()]  # its trials, in flight
    assert not decode.healthy  # (no third trial: not selectable now...)
    assert gw.is_ready() and gw.serves(), "a decode waiting only for its trials' answers flapped readiness"
    decode.closed(rids[0])
    assert decode.healthy and gw.is_ready()
    breaker.cooldown_s = 60.0
    breaker.record_failure()  # (a trial failed: open again, not ready)
    assert breaker.state is BreakerState.OPEN and not gw.is_ready()
    decode.is_draining = True
    assert not gw.is_ready()
