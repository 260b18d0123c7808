"""``pd-cluster``: a local PD cluster — bootstrap registry, prefill and decode workers, gateway.

Lifecycle:
1. Pick free loopback ports, start ``pd-bootstrap``, then every worker, each as its own process
   (the same Python interpreter), and wait until each answers its health check.
2. Start the gateway in front of them, wait for its health, print the URL and a curl example.
3. Run until Ctrl-C / SIGTERM or until any child exits; then stop every child (SIGTERM, then
   SIGKILL after a grace period) and exit non-zero if a child failed.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class Child:
    name: str
    argv: list[str]
    health_url: str
    proc: subprocess.Popen[bytes] | None = None


class Interrupted(RuntimeError):
    pass


@dataclass
class Cluster:
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    def spawn(self, child: Child) -> None:
        child.proc = subprocess.Popen(child.argv, start_new_session=True)
        self.children.append(child)

    def wait_healthy(self, child: Child, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        assert child.proc is not None
        while time.monotonic() < deadline:
            if self.stopping:
                raise Interrupted("interrupted during startup")
            if child.proc.poll() is not None:
                raise RuntimeError(f"{child.name} exited with code {child.proc.returncode} during startup")
            with contextlib.suppress(OSError, urllib.error.URLError), urllib.request.urlopen(
                child.health_url, timeout=2
            ) as resp:
                if resp.status == 200:
                    return
            time.sleep(0.2)
        raise RuntimeError(f"{child.name} was not healthy at {child.health_url} within {timeout_s:.0f}s")

    def failed_child(self) -> Child | None:
        return next((c for c in self.children if c.proc is not None and c.proc.poll() is not None), None)

    def stop(self, grace_s: float = 10.0) -> None:
        for child in reversed(self.children):  # gateway first, registry last
            if child.proc is not None and child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.kill()
                child.proc.wait()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-cluster", description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--engine", default="torch", help="engine for every worker: torch (real model) or sim")
    p.add_argument("--model", default=None,
                   help="model directory for the torch engine (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--transfer", default="tcp", help="KV transfer backend (tcp, mooncake, nixl)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="gateway port")
    p.add_argument("--bootstrap-port", type=int, default=0, help="registry port (0 = any free port)")
    p.add_argument("--policy", default="round_robin", help="gateway routing policy (see gateway --help)")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=1024, help="KV pages per worker")
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--log-level", default="warning")
    return p


def plan(args: argparse.Namespace) -> list[Child]:
    py, host = sys.executable, args.host
    boot_port = args.bootstrap_port or free_port(host)
    boot_url = f"http://{host}:{boot_port}"
    children = [Child("bootstrap", [py, "-m", "bootstrap.cli", "--host", host, "--port", str(boot_port)],
                      f"{boot_url}/health")]
    urls: dict[str, list[str]] = {"prefill": [], "decode": []}
    for role, count in (("prefill", args.prefill), ("decode", args.decode)):
        for i in range(count):
            port, http_port = free_port(host), free_port(host)
            argv = [py, "-m", "workers.cli", "--role", role, "--engine", args.engine, "--transfer", args.transfer,
                    "--host", host, "--port", str(port), "--http-port", str(http_port), "--bootstrap", boot_url,
                    "--page-size", str(args.page_size), "--num-pages", str(args.num_pages),
                    "--chunk-size", str(args.chunk_size), "--log-level", args.log_level]
            if args.model:
                argv += ["--model", args.model]
            for opt in args.engine_option:
                argv += ["--engine-option", opt]
            children.append(Child(f"{role}-{i}", argv, f"http://{host}:{http_port}/health"))
            urls[role].append(f"pd://{host}:{port}")
    gateway_argv = [py, "-m", "gateway.cli", "--host", host, "--port", str(args.port), "--policy", args.policy,
                    "--log-level", args.log_level, "--prefill", *urls["prefill"], "--decode", *urls["decode"]]
    for opt in args.policy_option:
        gateway_argv += ["--policy-option", opt]
    children.append(Child("gateway", gateway_argv, f"http://{host}:{args.port}/health"))
    return children


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.prefill < 1 or args.decode < 1:
        sys.exit("pd-cluster: --prefill and --decode must be at least 1")
    cluster = Cluster()

    def on_signal(signum: int, _frame: object) -> None:
        cluster.stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        for child in plan(args):
            cluster.spawn(child)
            if child.name == "bootstrap" or child.name == "gateway":
                cluster.wait_healthy(child, args.startup_timeout_s)
        for child in cluster.children:
            cluster.wait_healthy(child, args.startup_timeout_s)
        url = f"http://{args.host}:{args.port}"
        print(f"\npd-cluster ready: {args.prefill} prefill + {args.decode} decode ({args.engine}, {args.transfer})",
              flush=True)
        print(f"  OpenAI API: {url}/v1", flush=True)
        print(f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json' "
              "-d '{\"messages\": [{\"role\": \"user\", \"content\": \"What is the capital of France?\"}], "
              "\"max_tokens\": 32, \"temperature\": 0}'", flush=True)
        print("  Ctrl-C stops the cluster.", flush=True)
        while not cluster.stopping:
            failed = cluster.failed_child()
            if failed is not None:
                assert failed.proc is not None
                print(f"pd-cluster: {failed.name} exited with code {failed.proc.returncode}; stopping",
                      file=sys.stderr, flush=True)
                code = 1
                break
            time.sleep(0.5)
    except Interrupted:
        code = 0
    except RuntimeError as exc:
        print(f"pd-cluster: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        cluster.stop()
    sys.exit(code)


if __name__ == "__main__":
    main()
