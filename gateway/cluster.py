"""``pd-cluster``: a local PD cluster — bootstrap registry, prefill and decode workers, gateway.

Lifecycle:
1. Plan once: pick free loopback ports; each child keeps its argv (so its ports) and health URL for
   the life of the cluster, so a restarted child comes back where the others expect it.
2. Start ``pd-bootstrap`` and wait for its health, then every worker (each its own process, the
   same Python interpreter, its own session) and wait for each one's health, then the gateway in
   front of them; wait for its ``/readiness`` and print the URL and a curl example. A child that
   exits or stays unhealthy during startup stops the cluster (exit 1).
3. Supervise: a child that exits is restarted with the same argv after a backoff
   (``--restart-backoff-s``, doubled for each of its restarts within ``--restart-window-s``, at
   most 30 s), logged to stderr with its name, exit code and restart counter. A restarted child
   must answer its health check within ``--startup-timeout-s``, or it is killed and that counts
   as another failed run. A running child that fails its liveness check ``LIVENESS_FAILURES`` times
   in a row (a worker whose scheduler died answers 503; a frozen one nothing) is restarted the same
   way. The gateway reconnects to a restarted worker by itself; prefill workers register again with
   a restarted registry through their heartbeats.
4. Stop on Ctrl-C / SIGTERM / SIGHUP (exit 0; also during startup or a restart's backoff) or when a
   child would need more than ``--max-restarts`` restarts within ``--restart-window-s`` (a crash
   loop: exit 1; restarts that never became healthy again count however old). A bad flag is a usage
   error (exit 2) before anything starts. Stopping drains the gateway first (SIGTERM, then up to its
   drain timeout and a margin for its open requests to finish, the workers still serving them), then
   stops the workers, then the registry, each with SIGTERM and SIGKILL past a grace period, and reaps them all. A child
   also gets SIGTERM when the supervisor itself dies (Linux: the parent-death signal), so a killed
   ``pd-cluster`` leaves no children holding its ports.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import http.client
import io
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.cli_help import show_defaults
from transfer.netaddr import is_loopback, join_host_port

MAX_BACKOFF_S = 30.0
GATEWAY_DRAIN_S = 30.0  # the gateway's --drain-timeout-s (its default: the children are started with it)
# A running child is checked every --liveness-interval-s (a worker's /liveness: 503 once its scheduler
# died; the registry's and the gateway's /health); LIVENESS_FAILURES failures in a row (no answer within
# LIVENESS_TIMEOUT_S or the interval, or not 200) restart it, as a Kubernetes liveness probe would.
LIVENESS_FAILURES = 3
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")  # (what every child accepts)
LIVENESS_TIMEOUT_S = 2.0  # (the supervisor waits that long per frozen child and pass)
RESTART_GRACE_S = 2.0  # a running child being restarted: SIGTERM, then SIGKILL after this


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _env_port(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


_EPHEMERAL_LOW = _ephemeral_low()
# Mooncake's transfer engine listens (handshake and tcp data) on ports it draws at random from
# 15000-17000 (or MC_MIN_RPC_PORT..MC_MAX_RPC_PORT), whatever it is asked, so a port planned here and
# bound later may be taken by a Mooncake worker started in between
_MOONCAKE_PORTS = (range(15000, 17001),
                   range(_env_port("MC_MIN_RPC_PORT", 15000), _env_port("MC_MAX_RPC_PORT", 17000) + 1))
_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range and outside Mooncake's handshake range. A port
    the kernel hands out for port 0 can be taken again, before the child binds it (or rebinds it on
    a restart), by the local end of any outgoing connection, which draws from that same range.
    Also what the tests and load tests use."""
    low = 10000 if _EPHEMERAL_LOW > 12000 else 1024
    for _ in range(1000):
        port = random.randrange(low, _EPHEMERAL_LOW)
        if port in _handed_out or any(port in r for r in _MOONCAKE_PORTS):
            continue
        if not is_free(host, port):
            continue
        _handed_out.add(port)
        return port
    with socket.socket(_family(host)) as sock:  # the range is full: fall back to any free port
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _bare_host(text: str) -> str:
    """A host as the command line may bracket an IPv6 literal (``[::]``), without the brackets."""
    return text.strip("[]") if text.startswith("[") and text.endswith("]") else text


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def is_free(host: str, port: int) -> bool:
    """Can ``port`` be bound on ``host`` now, as the servers bind it (``SO_REUSEADDR``: a port whose last
    connections linger in TIME_WAIT, as after the cluster's own stop, is free; one listened on is not)?"""
    with socket.socket(_family(host)) as sock:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
        except OSError:
            return False
    return True


def log(message: str) -> None:
    print(f"pd-cluster: {message}", file=sys.stderr, flush=True)


def exit_text(code: int) -> str:
    try:
        name = f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        name = ""
    return f"exited with code {code}{name}"


@dataclass
class Child:
    name: str
    argv: list[str]
    health_url: str
    live_url: str = ""  # its liveness check (default: ``health_url``)
    proc: subprocess.Popen[bytes] | None = None
    recent_restarts: deque[float] = field(default_factory=deque)  # monotonic times, within the window
    num_restarts: int = 0
    restart_at: float | None = None  # in backoff: respawn at this monotonic time
    healthy_by: float | None = None  # restarted: must answer its health check by then
    live_failures: int = 0  # liveness checks failed in a row
    live_check_at: float = 0.0  # the next one (monotonic)
    # A running child whose port refuses connections has closed its listener: it is stopping (a gateway
    # told to drain by someone else than us, a worker closing). Not a liveness failure for this long.
    stop_grace_s: float = 10.0
    refusing_since: float | None = None

    def is_healthy(self, timeout_s: float = 2.0) -> bool:
        return _probe(self.health_url, timeout_s) == "ok"

    def liveness(self, timeout_s: float) -> str:
        """"ok", "refused" (nothing listens: the process is stopping) or "failed" (no answer in time, not 200)."""
        return _probe(self.live_url or self.health_url, timeout_s)


def _probe(url: str, timeout_s: float) -> str:
    """(Past any proxy the environment sets: ``main`` puts the children's hosts in ``no_proxy``.)"""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return "ok" if resp.status == 200 else "failed"
    except urllib.error.URLError as exc:
        return "refused" if isinstance(exc.reason, ConnectionRefusedError) else "failed"
    except ConnectionRefusedError:
        return "refused"
    except (OSError, http.client.HTTPException):  # (timeouts, resets, a reply that is not HTTP: another
        return "failed"                           # program on the port; HTTPError, a URLError, is above)


class Interrupted(RuntimeError):
    pass


class CrashLoop(RuntimeError):
    pass


@dataclass
class Cluster:
    startup_timeout_s: float = 600.0
    max_restarts: int = 5
    restart_window_s: float = 60.0
    restart_backoff_s: float = 0.5
    liveness_interval_s: float = 5.0
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    force: bool = False  # stopping, and told again: no more grace

    def spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))
        if child not in self.children:
            self.children.append(child)

    def wait_healthy(self, child: Child) -> None:
        """Startup: wait for ``child``'s health; any child exiting meanwhile is a startup failure."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.stopping:
                raise Interrupted("interrupted during startup")
            for other in self.children:
                if other.proc is not None and other.proc.poll() is not None:
                    raise RuntimeError(f"{other.name} {exit_text(other.proc.returncode)} during startup")
            if child.is_healthy():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{child.name} was not healthy at {child.health_url} within {self.startup_timeout_s:g}s")

    def supervise(self) -> None:
        """One pass: respawn children whose backoff is over, check restarted ones, restart dead ones."""
        for child in self.children:
            if self.stopping:
                return
            assert child.proc is not None
            now = time.monotonic()
            if child.restart_at is not None:
                if now >= child.restart_at:
                    child.restart_at, child.healthy_by = None, now + self.startup_timeout_s
                    self.spawn(child)
                continue
            code = child.proc.poll()
            if code is None and child.healthy_by is not None:
                if child.is_healthy(timeout_s=1.0):
                    child.healthy_by = None
                    log(f"{child.name} is healthy again after restart {child.num_restarts}")
                elif now >= child.healthy_by:
                    self.restart(child, f"was not healthy within {self.startup_timeout_s:g}s of its restart")
                continue
            if code is not None:
                self.restart(child, exit_text(code))
            elif now >= child.live_check_at:  # running, but alive? (a worker whose scheduler died, a frozen one)
                child.live_check_at = now + self.liveness_interval_s
                live = child.liveness(min(self.liveness_interval_s, LIVENESS_TIMEOUT_S))
                if live == "refused":  # stopping: it gets its grace to end on its own (then it is restarted)
                    child.refusing_since = child.refusing_since or now
                    if now - child.refusing_since < child.stop_grace_s:
                        continue
                else:
                    child.refusing_since = None
                child.live_failures = 0 if live == "ok" else child.live_failures + 1
                if child.live_failures >= LIVENESS_FAILURES:
                    self.restart(child, f"failed {LIVENESS_FAILURES} liveness checks in a row "
                                        f"({child.live_url or child.health_url})")

    def restart(self, child: Child, what: str) -> None:
        """Schedule ``child``'s restart after a backoff, or raise ``CrashLoop`` past the limit."""
        assert child.proc is not None
        if child.proc.poll() is None:  # (unhealthy or not live: SIGTERM first, so a prefill deregisters)
            with contextlib.suppress(ProcessLookupError):
                child.proc.send_signal(signal.SIGTERM)
            kill(child.proc, RESTART_GRACE_S)
        now = time.monotonic()
        # A restart that never answered its health check again is no recovery: the restarts before it count
        # however old (a child that loads for longer than the window, or hangs until --startup-timeout-s,
        # then fails, found them aged out each time and was restarted for ever)
        while (child.healthy_by is None and child.recent_restarts
               and child.recent_restarts[0] <= now - self.restart_window_s):
            child.recent_restarts.popleft()
        if self.max_restarts == 0:
            raise CrashLoop(f"{child.name} {what}; restarts are off (--max-restarts 0), stopping the cluster")
        if len(child.recent_restarts) >= self.max_restarts:
            raise CrashLoop(
                f"{child.name} {what} after {len(child.recent_restarts)} restarts within {self.restart_window_s:g}s "
                f"(--max-restarts {self.max_restarts}): crash loop, stopping the cluster"
            )
        child.recent_restarts.append(now)
        child.num_restarts += 1
        # (the doubling bounded: from the 1,025th restart within the window on, 2 ** n overflowed a float)
        doublings = min(len(child.recent_restarts) - 1, 64)
        delay = min(self.restart_backoff_s * 2 ** doublings, max(self.restart_backoff_s, MAX_BACKOFF_S))
        child.restart_at, child.healthy_by, child.live_failures, child.refusing_since = now + delay, None, 0, None
        log(f"{child.name} {what}; restart {child.num_restarts} "
            f"({len(child.recent_restarts)}/{self.max_restarts} within {self.restart_window_s:g}s) in {delay:.1f}s")

    def stop(self, grace_s: float = 10.0, drain_s: float = GATEWAY_DRAIN_S + 5.0) -> None:
        """The gateway first (it drains: its open requests finish on the workers, which still run), then
        the workers together, then the registry. A signal meanwhile (``force``) cuts every wait short."""
        children = [c for c in self.children if c.proc is not None]
        gateway = [c for c in children if c.name == "gateway"]
        registry = [c for c in children if c.name == "bootstrap"]
        workers = [c for c in children if c not in gateway and c not in registry]
        for group, wait_s in ((gateway, drain_s), (workers, grace_s), (registry, grace_s)):
            for child in group:
                assert child.proc is not None
                if child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + wait_s
            while not self.force and time.monotonic() < deadline and any(
                    c.proc is not None and c.proc.poll() is None for c in group):
                time.sleep(0.05)
            for child in group:
                assert child.proc is not None
                kill(child.proc)


def _die_with_parent(parent_pid: int) -> Any:
    """A ``preexec_fn``: the child gets SIGTERM when the supervisor dies (Linux ``PR_SET_PDEATHSIG``),
    also a SIGKILLed one; elsewhere nothing. (The child is in its own session, so a terminal's
    hang-up or Ctrl-C reaches only the supervisor, which stops the children itself.)"""
    def arm() -> None:
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent_pid:  # the supervisor died before the signal was armed
                os.kill(os.getpid(), signal.SIGTERM)

    return arm


_PR_SET_PDEATHSIG = 1


def kill(proc: subprocess.Popen[bytes], grace_s: float = 0.0) -> None:
    """Wait up to ``grace_s`` for ``proc`` to exit, then SIGKILL it; always reaps it."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-cluster", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--engine", default="torch", help="engine for every worker: torch (real model) or sim")
    p.add_argument("--model", default=None,
                   help="model directory for the torch engine (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--transfer", default="tcp", help="KV transfer backend (tcp, mooncake, nixl)")
    p.add_argument("--host", default="127.0.0.1", type=_bare_host,
                   help="address every child binds (0.0.0.0: all IPv4 interfaces; ::, or [::]: all interfaces)")
    p.add_argument("--advertise-host", default=None, type=_bare_host,
                   help="address the workers advertise and the gateway and registry are reached at (default: --host, "
                        "or 127.0.0.1 when that is 0.0.0.0 or ::)")
    p.add_argument("--transfer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="transfer-backend setting for every worker (repeatable; see docs/transfer.md)")
    p.add_argument("--port", type=int, default=8000, help="gateway port (0 = any free port)")
    p.add_argument("--bootstrap-port", type=int, default=0, help="registry port (0 = any free port)")
    p.add_argument("--policy", default="round_robin", help="gateway routing policy (see gateway --help)")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="gateway routing-policy setting (repeatable; see gateway --help)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page, every worker")
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages per worker")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size in tokens")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine setting for every worker (repeatable; see pd-worker --help)")
    p.add_argument("--gateway-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for the gateway, as is (repeatable; flags with a value as "
                        "--gateway-arg=--max-client-connections=2048); see gateway --help")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for every worker, as is (repeatable; e.g. "
                        "--worker-arg=--grammar-timeout-s=10); see pd-worker --help")
    p.add_argument("--startup-timeout-s", type=float, default=600.0,
                   help="how long a child may take to become healthy, at startup and after a restart")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="a child needing more restarts than this within --restart-window-s stops the cluster "
                        "(exit 1); 0 = stop when any child exits")
    p.add_argument("--restart-window-s", type=float, default=60.0, help="the window --max-restarts counts in")
    p.add_argument("--restart-backoff-s", type=float, default=0.5,
                   help=f"delay before a restart; doubles for each recent restart of that child, at most "
                        f"{MAX_BACKOFF_S:g}s")
    p.add_argument("--liveness-interval-s", type=float, default=5.0,
                   help=f"how often a running child's liveness is checked (each check waits for its answer for "
                        f"the interval, at most {LIVENESS_TIMEOUT_S:g}s); {LIVENESS_FAILURES} failures in a row "
                        "restart it")
    p.add_argument("--log-level", default="warning", choices=LOG_LEVELS, type=str.lower,
                   help="every child's (default %(default)s)")
    return show_defaults(p)


def _no_proxy_for(*hosts: str) -> None:
    """The children (and this process's checks) reach each other on ``hosts`` directly, whatever proxy the
    environment sets for outbound HTTP (the registry clients and health checks honour ``http_proxy``; without
    a ``no_proxy`` for these hosts every one of them failed)."""
    given = [entry for name in ("no_proxy", "NO_PROXY") for entry in os.environ.get(name, "").split(",")]
    merged = ",".join(dict.fromkeys(filter(None, [*given, *hosts])))  # (either spelling's entries, in both)
    for name in ("no_proxy", "NO_PROXY"):
        os.environ[name] = merged


def reach_host(args: argparse.Namespace) -> str:
    """Where the children reach each other (and are advertised, and the gateway is printed at)."""
    return str(args.advertise_host or ("127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host))


def _worker_args(args: argparse.Namespace, role: str, port: int, http_port: int, boot_url: str) -> list[str]:
    """A worker's arguments (after ``python -m workers.cli``), ``--worker-arg`` last."""
    argv = ["--role", role, "--engine", args.engine, "--transfer", args.transfer,
            "--host", args.host, "--port", str(port), "--http-port", str(http_port), "--bootstrap", boot_url,
            "--page-size", str(args.page_size), "--num-pages", str(args.num_pages),
            "--chunk-size", str(args.chunk_size), "--log-level", args.log_level]
    if args.model:
        argv += ["--model", args.model]
    for opt in args.engine_option:
        argv += ["--engine-option", opt]
    for opt in args.transfer_option:
        argv += ["--transfer-option", opt]
    if args.advertise_host:
        argv += ["--advertise-host", args.advertise_host]
    return argv + args.worker_arg


def _gateway_args(args: argparse.Namespace, prefill: list[str], decode: list[str]) -> list[str]:
    """The gateway's arguments (after ``python -m gateway.cli``), ``--gateway-arg`` last."""
    argv = ["--host", args.host, "--port", str(args.port), "--policy", args.policy,
            "--log-level", args.log_level, "--prefill", *prefill, "--decode", *decode]
    for opt in args.policy_option:
        argv += ["--policy-option", opt]
    return argv + args.gateway_arg


def plan(args: argparse.Namespace) -> list[Child]:
    py, host = sys.executable, args.host
    _handed_out.update(p for p in (args.port, args.bootstrap_port) if p)  # (chosen: not for a worker)
    reach = reach_host(args)
    if args.port and args.port == args.bootstrap_port:
        raise RuntimeError(f"--port and --bootstrap-port are both {args.port}: the gateway and the registry "
                           "need one each")
    for name, port in (("--port", args.port), ("--bootstrap-port", args.bootstrap_port)):
        if port and not is_free(host, port):  # (else whatever listens there would pass our child's health checks)
            raise RuntimeError(f"{name} {port}: the port is in use on {host}")
    boot_port = args.bootstrap_port or free_port(host)
    boot_url = f"http://{join_host_port(reach, boot_port)}"
    children = [Child("bootstrap", [py, "-m", "bootstrap.cli", "--host", host, "--port", str(boot_port),
                                    "--log-level", args.log_level], f"{boot_url}/health")]
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port, http_port = free_port(host), free_port(host)
            argv = [py, "-m", "workers.cli", *_worker_args(args, role, port, http_port, boot_url)]
            children.append(Child(f"{role}-{i}", argv, f"http://{join_host_port(reach, http_port)}/health",
                                  f"http://{join_host_port(reach, http_port)}/liveness"))
            urls[role].append(f"pd://{join_host_port(reach, port)}")
    gateway_argv = [py, "-m", "gateway.cli", *_gateway_args(args, urls["prefill"], urls["decode"])]
    gateway_url = f"http://{join_host_port(reach, args.port)}"
    children.append(Child("gateway", gateway_argv, f"{gateway_url}/readiness", f"{gateway_url}/health",
                          stop_grace_s=GATEWAY_DRAIN_S + 5.0))
    return children


def _children_args_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with ``--gateway-arg`` / ``--worker-arg`` (each child's own parser and configuration
    checks, on an argument list like the one it will get), or None: a bad one is a usage error before anything
    starts, not children failing one after another."""
    from gateway import cli as gateway_cli
    from workers import cli as worker_cli
    from workers.config import ConfigError

    # (the very argument lists ``plan`` gives, but for the ports and URLs it picks then; a worker's of each role)
    checks = [("--gateway-arg", "the gateway", gateway_cli, args.gateway_arg,
               _gateway_args(args, ["pd://127.0.0.1:1"], ["pd://127.0.0.1:2"]))]
    checks += [("--worker-arg", f"a {role} worker", worker_cli, args.worker_arg,
                _worker_args(args, role, 1, 2, "http://127.0.0.1:3")) for role in ("prefill", "decode")]
    for flag, child, cli, extra, argv in checks:
        if not extra:
            continue
        parser = cli.build_parser()
        parser.exit_on_error = False
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                parsed, unknown = parser.parse_known_args(argv)
                ours = parser.parse_known_args(argv[:len(argv) - len(extra)])[0]
            if unknown:
                return f"{flag}: {child} takes no {' '.join(unknown)}"
            # A setting pd-cluster makes itself (ports, role, registry, ...) is not overridden from here: every
            # worker would get the one --port, a prefill would turn decode. Its repeatable ones add up, as given.
            for action in parser._actions:
                if action.option_strings and not isinstance(action, argparse._AppendAction) \
                        and any(option in argv[:len(argv) - len(extra)] for option in action.option_strings) \
                        and getattr(parsed, action.dest) != getattr(ours, action.dest):
                    return (f"{flag}: pd-cluster sets {action.option_strings[-1]} for {child} itself (use its own "
                            "flag for it, where it has one)")
            cli.config_from_args(parsed)
        except (argparse.ArgumentError, ValueError, TypeError, ConfigError) as exc:
            return f"{flag}: {child}: {exc}"
        except SystemExit:  # (argparse exits on some errors whatever exit_on_error says)
            lines = said.getvalue().strip().splitlines()
            return f"{flag}: {child}: {lines[-1] if lines else ' '.join(extra)}"
    return None


def _cluster_secrets() -> None:
    """A cluster whose servers bind beyond loopback: its workers want a key of their peers (the gateway's
    ``--worker-api-key``) and its registry a token for writes, each random unless the environment sets it
    (``PD_WORKER_API_KEY``, ``PD_BOOTSTRAP_TOKEN``); the children read them from the environment they inherit
    (never on a command line, which ``ps`` shows)."""
    for name in ("PD_WORKER_API_KEY", "PD_BOOTSTRAP_TOKEN"):
        if not os.environ.get(name):
            os.environ[name] = secrets.token_urlsafe(24)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    # A bad flag is a usage error (exit 2) before anything starts, not a cluster half started and then stopped
    if args.prefill < 1 or args.decode < 1:
        parser.error("--prefill and --decode must be at least 1")
    if (args.max_restarts < 0 or not 0 < args.restart_window_s < math.inf
            or not 0 <= args.restart_backoff_s < math.inf):  # (``not``: NaN fails every comparison)
        parser.error("--max-restarts and --restart-backoff-s must be >= 0, --restart-window-s > 0 (finite)")
    if not args.liveness_interval_s > 0:
        parser.error("--liveness-interval-s must be positive")
    if not args.startup_timeout_s > 0:  # (NaN: no child was ever healthy in time, and a restarted one never late)
        parser.error("--startup-timeout-s must be positive")
    for name in ("page_size", "num_pages", "chunk_size"):  # (else every worker exits during startup)
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0 <= args.port <= 65535 or not 0 <= args.bootstrap_port <= 65535:
        parser.error("--port and --bootstrap-port must be TCP ports")
    if args.port and args.port == args.bootstrap_port:
        parser.error(f"--port and --bootstrap-port are both {args.port}: the gateway and the registry need one each")
    if problem := _children_args_problem(args):
        parser.error(problem)
    if args.port == 0:  # (any free port, as --bootstrap-port 0; printed with the URL)
        args.port = free_port(args.host)
    cluster = Cluster(args.startup_timeout_s, args.max_restarts, args.restart_window_s, args.restart_backoff_s,
                      args.liveness_interval_s)

    def on_signal(signum: int, _frame: object) -> None:
        cluster.force = cluster.stopping  # (a second Ctrl-C or SIGTERM while stopping: SIGKILL what is left)
        cluster.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # (under nohup it stays ignored)
        signal.signal(signal.SIGHUP, on_signal)  # the terminal closed: its children are in their own sessions
    _no_proxy_for("127.0.0.1", "localhost", "::1", reach_host(args))
    if not is_loopback(args.host):  # reachable from elsewhere: the workers and the registry take keys
        _cluster_secrets()
    code = 0
    try:
        children = plan(args)
        cluster.spawn(children[0])  # the registry, which the workers need first
        cluster.wait_healthy(children[0])
        for child in children[1:-1]:
            cluster.spawn(child)
        for child in children[1:-1]:
            cluster.wait_healthy(child)
        cluster.spawn(children[-1])  # the gateway
        cluster.wait_healthy(children[-1])
        url = f"http://{join_host_port(reach_host(args), args.port)}"
        print(f"\npd-cluster ready: {args.prefill} prefill + {args.decode} decode ({args.engine}, {args.transfer})",
              flush=True)
        print(f"  OpenAI API: {url}/v1", flush=True)
        print(f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
              "\"max_tokens\": 32, \"temperature\": 0}'", flush=True)
        print("  Ctrl-C stops the cluster.", flush=True)
        while not cluster.stopping:
            cluster.supervise()
            time.sleep(0.2)
    except Interrupted:
        code = 0
    except RuntimeError as exc:  # a startup failure or a CrashLoop
        log(str(exc))
        code = 1
    finally:
        cluster.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
