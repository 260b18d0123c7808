"""The gateway's start-up and worker loss as an operator sees them: its port opens while workers are
down (liveness answers, SIGTERM is heard), and a worker connection that is lost is said in its log."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request

from pdtest import Procs, free_port, start_bootstrap, start_worker, wait_http_ok


def _status(url: str) -> int | str:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError as exc:
        return repr(exc)


def test_liveness_answers_while_the_gateway_waits_for_a_missing_decode(procs: Procs) -> None:
    """A decode that is down at start-up does not keep the gateway's port shut for --startup-timeout-s:
    /health (liveness) and /metrics answer at once, /readiness is a 503 until a pair is there, and once
    the decode comes up the gateway serves without a restart."""
    boot = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", "--engine", "sim", "--num-pages", "64", bootstrap=boot)
    decode_port = free_port()
    port = free_port()
    proc = procs.start(f"gateway-{port}", "-m", "gateway.cli", "--port", str(port), "--log-level", "warning",
                       "--prefill", prefill.url, "--decode", f"pd://127.0.0.1:{decode_port}",
                       "--startup-timeout-s", "120")
    wait_http_ok(f"http://127.0.0.1:{port}/health", 20, proc)  # (well within the 120 s start-up wait)
    assert _status(f"http://127.0.0.1:{port}/metrics") == 200
    assert _status(f"http://127.0.0.1:{port}/readiness") == 503
    start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", "--port", str(decode_port), bootstrap=boot)
    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)


def test_sigterm_while_the_gateway_waits_for_its_workers_stops_it_at_once(procs: Procs) -> None:
    """No worker answers: SIGTERM a few seconds into the start-up wait ends the gateway within seconds, not
    when the wait would have ended (an orchestrator's grace period would end in a SIGKILL)."""
    port = free_port()
    proc = procs.start(f"gateway-{port}", "-m", "gateway.cli", "--port", str(port), "--log-level", "info",
                       "--prefill", f"pd://127.0.0.1:{free_port()}", "--decode", f"pd://127.0.0.1:{free_port()}",
                       "--startup-timeout-s", "120")
    wait_http_ok(f"http://127.0.0.1:{port}/health", 20, proc)
    proc.send_signal(signal.SIGTERM)
    proc.wait(20)  # (raises if it is still running: the wait was 120 s)


def test_a_lost_worker_connection_is_logged_once(procs: Procs) -> None:
    """An idle decode that dies is a warning in the gateway's log naming it (reconnects are tried
    quietly), as its coming back is an info line."""
    boot = start_bootstrap(procs)
    prefill = start_worker(procs, "prefill", "--engine", "sim", "--num-pages", "64", bootstrap=boot)
    decodes = [start_worker(procs, "decode", "--engine", "sim", "--num-pages", "64", bootstrap=boot)
               for _ in range(2)]
    port = free_port()
    name = f"gateway-{port}"
    proc = procs.start(name, "-m", "gateway.cli", "--port", str(port), "--log-level", "info",
                       "--prefill", prefill.url, "--decode", *[d.url for d in decodes])
    wait_http_ok(f"http://127.0.0.1:{port}/readiness", 60, proc)
    victim = decodes[0]
    victim.proc.kill()
    victim.proc.wait()
    lines: list[str] = []
    for _ in range(100):
        time.sleep(0.1)
        lines = [line for line in procs.log(name).splitlines() if "lost connection" in line and victim.url in line]
        if lines:
            break
    time.sleep(1.0)  # (several reconnect tries by now)
    lines = [line for line in procs.log(name).splitlines() if "lost connection" in line and victim.url in line]
    assert len(lines) == 1 and "WARNING" in lines[0].upper(), procs.log(name)[-3000:]
