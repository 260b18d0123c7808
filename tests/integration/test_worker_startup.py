"""Startup errors name the problem and exit non-zero (no half-started worker)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path


def run_worker(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", "--role", "both", "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=120)


def test_missing_config_json(tmp_path: Path) -> None:
    out = run_worker("--engine", "torch", "--model", str(tmp_path))
    assert out.returncode != 0 and "config.json" in out.stderr


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    out = run_worker("--engine", "torch", "--model", str(tmp_path))
    assert out.returncode != 0 and "mamba" in out.stderr


def test_unknown_engine_and_bad_flags() -> None:
    out = run_worker("--engine", "warp-drive")
    assert out.returncode != 0 and "warp-drive" in out.stderr and "sim" in out.stderr
    out = run_worker("--page-size", "0")
    assert out.returncode != 0 and "page_size" in out.stderr
    for flag, name in (("--transfer-timeout-s", "transfer_timeout_s"), ("--max-unread-mib", "max_unread_mib")):
        out = run_worker(flag, "nan")  # (refused before the engine loads, without a traceback)
        assert out.returncode != 0 and f"bad configuration: {name}" in out.stderr, out.stderr[-2000:]
        assert "Traceback" not in out.stderr


def test_a_prefill_needs_a_registry() -> None:
    """A prefill registers its KV endpoint; a decode needs none (each request names its prefill's registry)."""
    out = subprocess.run([sys.executable, "-m", "workers.cli", "--role", "prefill"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "bootstrap" in out.stderr


def run_role(role: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "workers.cli", "--role", role, "--log-level", "error", *args],
                          capture_output=True, text=True, timeout=120)


def test_bad_transfer_option_names_backend_and_option() -> None:
    out = run_role("decode", "--transfer", "tcp", "--transfer-option", "warp_factor=9")
    assert out.returncode != 0 and "'tcp'" in out.stderr and "warp_factor" in out.stderr
    out = run_role("decode", "--transfer", "nixl", "--transfer-option", "ucx_tls=carrier_pigeon")
    assert out.returncode != 0 and "'nixl'" in out.stderr and "ucx_tls" in out.stderr
    out = run_role("decode", "--transfer-option", "novalue")
    assert out.returncode != 0 and "KEY=VALUE" in out.stderr


def test_unusable_addresses_are_refused_at_startup() -> None:
    out = run_role("decode", "--host", "192.0.2.7")  # TEST-NET-1: no interface of ours has it
    assert out.returncode != 0 and "--host 192.0.2.7: not an address of this machine" in out.stderr
    out = run_role("decode", "--host", "127.0.0.1", "--advertise-host", "127.0.0.2")
    assert out.returncode != 0 and "does not match --host 127.0.0.1" in out.stderr
    out = run_role("decode", "--host", "0.0.0.0", "--advertise-host", "192.0.2.7")
    assert out.returncode != 0 and "--advertise-host 192.0.2.7: not an address of this machine" in out.stderr
    # loopback advertised while the registry is on another host: nobody there could reach us
    out = run_role("prefill", "--host", "127.0.0.1", "--bootstrap", "http://192.0.2.8:8998")
    assert out.returncode != 0 and "loopback" in out.stderr and "192.0.2.8" in out.stderr


def test_a_prefill_takes_connections_only_once_registered(tmp_path: Path) -> None:
    """Until its registry has its KV address, a prefill's native port refuses connections and its
    ``/health`` says "starting" (503; ``/liveness`` 200): no gateway can send it a request whose decode would look it up
    and find nothing, or (restarted on its port) the address of its previous run."""
    import socket
    import time

    import httpx
    from pdtest import Procs, free_port, wait_http_ok

    procs = Procs(tmp_path)
    try:
        registry_port, port, http_port = free_port(), free_port(), free_port()
        proc = procs.start("prefill", "-m", "workers.cli", "--role", "prefill", "--port", str(port),
                           "--http-port", str(http_port), "--log-level", "warning",
                           "--bootstrap", f"http://127.0.0.1:{registry_port}")  # nothing there yet
        deadline = time.monotonic() + 120
        while True:  # its HTTP side is up, still retrying the registration
            assert proc.poll() is None, procs.log("prefill")
            try:
                health = httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, procs.log("prefill")
                time.sleep(0.05)
        assert health.status_code == 503 and health.json()["status"] == "starting"
        live = httpx.get(f"http://127.0.0.1:{http_port}/liveness", timeout=2)  # alive, only not ready
        assert live.status_code == 200 and live.json()["status"] == "starting"
        with socket.socket() as sock, contextlib.suppress(ConnectionRefusedError):
            sock.connect(("127.0.0.1", port))
            raise AssertionError("the native port accepted a connection before the prefill was registered")

        registry = procs.start("registry", "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(registry_port))
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 60, proc)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass

        # Its registry goes away: once its renewals have failed a few times in a row its entry has lapsed
        # (decodes cannot look it up): /health says so (503, alive), and is 200 again once it renews.
        registry.terminate()
        registry.wait(30)
        deadline = time.monotonic() + 60
        while (health := httpx.get(f"http://127.0.0.1:{http_port}/health", timeout=5)).status_code == 200:
            assert time.monotonic() < deadline, "still healthy with its registry gone"
            time.sleep(0.2)
        assert health.status_code == 503 and health.json()["status"] == "unregistered", health.text
        assert "registry renewals failed" in health.json()["error"]
        assert httpx.get(f"http://127.0.0.1:{http_port}/liveness", timeout=5).status_code == 200
        procs.start("registry-again", "-m", "bootstrap.cli", "--host", "127.0.0.1", "--port", str(registry_port))
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 60, proc)
    finally:
        procs.stop_all()


def test_a_decode_refused_by_its_registry_does_not_start(tmp_path: Path) -> None:
    """A decode whose ``--bootstrap-token`` the registry refuses would pass its health checks and fail every
    request's look-up of its prefill: it stops at start-up, naming the flag. The right token starts."""
    from pdtest import Procs, start_bootstrap, start_worker

    procs = Procs(tmp_path)
    try:
        registry = start_bootstrap(procs, "--token", "s3cret")
        out = run_role("decode", "--port", "0", "--http-port", "0", "--bootstrap", registry,
                       "--bootstrap-token", "wrong")
        assert out.returncode != 0 and "refused this worker's token (401)" in out.stderr, out.stderr[-2000:]
        assert "--bootstrap-token" in out.stderr
        assert "Traceback" not in out.stderr, out.stderr[-2000:]  # (a setting's fault: its message, not a trace)
        out = run_role("decode", "--port", "0", "--http-port", "0", "--bootstrap", registry)  # none at all
        assert out.returncode != 0 and "(401)" in out.stderr, out.stderr[-2000:]
        start_worker(procs, "decode", "--bootstrap-token", "s3cret", bootstrap=registry)
        for url in ("http://127.0.0.1:notaport", "ftp://127.0.0.1:8998"):  # (a bare host:port is one: http://)
            out = run_role("decode", "--port", "0", "--http-port", "0", "--bootstrap", url)
            assert out.returncode != 0 and "pd-worker: bad configuration: bootstrap: not a registry URL" in \
                out.stderr and repr(url) in out.stderr, out.stderr[-2000:]
    finally:
        procs.stop_all()


def test_an_http_port_in_use_is_a_one_line_error() -> None:
    """Like a native port in use: exit 1 naming the problem (uvicorn's own bind ended the process with
    code 3 and a traceback, past the worker's clean-up)."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        out = run_worker("--http-port", str(taken.getsockname()[1]))
    assert out.returncode == 1, out.stderr[-2000:]
    assert "Address already in use" in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def _started_worker(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    import os

    return subprocess.Popen([sys.executable, "-m", "workers.cli", "--log-level", "warning", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})}, cwd=Path(__file__).resolve().parents[2])


def test_a_second_signal_does_not_cut_the_clean_up_short(tmp_path: Path) -> None:
    """SIGTERM, then another while the worker closes (Ctrl-C twice): it still closes cleanly, exit 0, no
    traceback, and leaves none of its shared-memory files behind."""
    import os
    import signal
    import time

    from pdtest import free_port, wait_http_ok

    http_port = free_port()
    proc = _started_worker(tmp_path, "--role", "decode", "--http-port", str(http_port))
    try:
        wait_http_ok(f"http://127.0.0.1:{http_port}/health", 120, proc)
        proc.send_signal(signal.SIGTERM)
        for _ in range(100):  # (Ctrl-C, again and again, until it has exited)
            time.sleep(0.01)
            if proc.poll() is not None:
                break
            proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in out, out[-3000:]
    assert not [name for name in os.listdir("/dev/shm") if f"-{proc.pid}-" in name]


def test_a_worker_stopped_while_its_engine_loads_exits_at_once(tmp_path: Path) -> None:
    """SIGTERM while the engine loads (a large model takes minutes): the worker exits without waiting for
    the load to end (a supervisor would SIGKILL it after its grace period)."""
    import signal
    import time

    (tmp_path / "slowengine.py").write_text(
        "import time\nfrom workers.engines.sim import SimEngine\n\n\n"
        "class SlowEngine(SimEngine):\n    def __init__(self, *args, **kwargs):\n"
        "        time.sleep(60)\n        super().__init__(*args, **kwargs)\n")
    proc = _started_worker(tmp_path, "--role", "both", "--engine", "slowengine:SlowEngine",
                           env={"PYTHONPATH": str(tmp_path)})
    try:
        time.sleep(5)  # (imports done, loading)
        assert proc.poll() is None
        stopped = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert time.monotonic() - stopped < 30, "it waited for the engine's load to end"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in out, out[-3000:]
