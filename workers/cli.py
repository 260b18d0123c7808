"""``pd-worker``: run one prefill, decode or combined worker process."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys

from gateway.cli_help import show_defaults
from workers.config import ConfigError, WorkerConfig
from workers.grammar import GRAMMAR_TIMEOUT_S
from workers.protocol import MAX_UNREAD_BYTES, PEER_TIMEOUT_S

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pd-worker", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--role", choices=["prefill", "decode", "both"], default="both")
    p.add_argument("--engine", default="sim", help="engine plugin name (sim, torch) or module:attr")
    p.add_argument("--model", default=None, help="model directory (torch engine); 'default' = SmolLM2")
    p.add_argument("--transfer", default="tcp", help="KV transfer backend (tcp, mooncake, nixl, fake)")
    p.add_argument("--host", default="127.0.0.1", help="address every socket binds (0.0.0.0: all interfaces)")
    p.add_argument("--advertise-host", default=None,
                   help="address peers are told (registry entry, KV control, data endpoint); default: --host, "
                        "or when that is 0.0.0.0 the address of the interface that routes to the registry")
    p.add_argument("--port", type=int, default=0, help="native protocol port (0 = any free port)")
    p.add_argument("--http-port", type=int, default=0, help="HTTP side port (health, info, debug)")
    p.add_argument("--bootstrap", default=None, help="bootstrap registry URL, e.g. http://127.0.0.1:8998")
    p.add_argument("--bootstrap-embedded", type=int, default=None, metavar="PORT",
                   help="prefill only: serve the bootstrap registry inside this worker (SGLang-style)")
    p.add_argument("--bootstrap-token", default=None,  # (not the variable's value: --help would print the secret)
                   help="the registry's bearer token; default: $PD_BOOTSTRAP_TOKEN")
    p.add_argument("--api-key", default=None,
                   help="required of the gateway (its --worker-api-key) on the native port and of every HTTP request "
                        "but the health probes; default: $PD_WORKER_API_KEY")
    p.add_argument("--api-key-file", default=None, help="--api-key read from this file (one line; # comments)")
    p.add_argument("--instance-id", default=None, help="prefill instance key in the registry")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk size in tokens")
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--max-requests", type=int, default=4096,
                   help="requests held at once, in any stage; more are refused as overloaded (429)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--attention", default="auto")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--bootstrap-timeout-s", type=float, default=300.0)
    p.add_argument("--waiting-timeout-s", type=float, default=300.0)
    p.add_argument("--transfer-timeout-s", type=float, default=60.0)
    p.add_argument("--quarantine-timeout-s", type=float, default=300.0,
                   help="decode over mooncake/nixl: a failed room's pages wait at most this long (time this worker "
                        "ran) for a silent prefill to confirm that none of its writes can still land, then go back "
                        "to the pool, unfenced (inf: until it answers or dies)")
    p.add_argument("--http-request-timeout-s", type=float, default=1800.0,
                   help="a request arriving over SGLang's HTTP API (SGLang's routers) ends by this deadline")
    p.add_argument("--max-http-connections", type=int, default=0,
                   help="connections the HTTP port serves at once (0 = --max-requests + 256, as an SGLang router "
                        "holds one per request; at most a quarter of ulimit -n); past it an idle one is closed for a "
                        "new one, else up to 8 more may send a probe (/health, /liveness, /health_generate, /metrics, "
                        "the SGLang routers' load and info reads), the rest are answered 503 too_many_connections")
    p.add_argument("--gateway-timeout-s", type=float, default=PEER_TIMEOUT_S,
                   help="a gateway connection whose host answers nothing this long (it died, or the network was "
                        "cut) is closed by the kernel and its requests end (TCP keep-alive, TCP_USER_TIMEOUT)")
    p.add_argument("--http-keep-alive-timeout-s", type=float, default=5.0,
                   help="an HTTP connection idle between requests this long is closed (uvicorn's default; keep it "
                        "above the idle time of the callers' connection pools)")
    p.add_argument("--heartbeat-interval-s", type=float, default=2.0,
                   help="KV peers ping each other this often (silent for 3x: gone); a prefill renews its "
                        "bootstrap registration this often too, but at least every 2.5 s (the registry's "
                        "lease: 10 s by default)")
    p.add_argument("--registry-wait-s", type=float, default=0.0,
                   help="a prefill started before its --bootstrap registry is up waits this long for it (its native "
                        "port closed, /health 503 meanwhile), then exits; 0: no limit")
    p.add_argument("--drain-timeout-s", type=float, default=0.0,
                   help="on SIGTERM/SIGINT the requests held already (streams, prefills and their KV transfers, rooms "
                        "whose KV is arriving) run on for up to this long while new ones are refused shutting_down, "
                        "then the rest end shutting_down; a second signal ends the drain at once. 0: they end at once "
                        "(our gateway retries or migrates them); behind a router that does not (SGLang's), set it to "
                        "the orchestrator's grace period less a margin")
    p.add_argument("--watchdog-timeout-s", type=float, default=300.0,
                   help="/liveness answers 503 once the scheduler, holding requests, has not finished a step for "
                        "this long (a hung forward), so that the worker is restarted")
    p.add_argument("--grammar-timeout-s", type=float, default=GRAMMAR_TIMEOUT_S,
                   help="a constrained request (response_format, regex, ebnf) whose grammar has not compiled this long "
                        "after it arrived fails: with a 400 naming its field if its compile ran at least half of "
                        "this, else (it waited for a busy compile thread) as overloaded, retried elsewhere")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=VALUE",
                   help="engine-specific setting (repeatable), e.g. decode_step_s=0.002 for sim")
    p.add_argument("--transfer-option", action="append", default=[], metavar="KEY=VALUE",
                   help="transfer-backend setting (repeatable), e.g. protocol=rdma for mooncake, ucx_tls=tcp for "
                        "nixl; see docs/transfer.md")
    p.add_argument("--same-host-kv", choices=["auto", "off"], default="auto",
                   help="auto: KV goes through shared memory to a peer on this host that proves it maps the "
                        "decode's pool, else over --transfer; off: always over --transfer (docs/transfer.md)")
    p.add_argument("--max-unread-mib", type=float, default=MAX_UNREAD_BYTES / 2**20,
                   help="output a gateway connection may leave unread before it is dropped (its requests end)")
    p.add_argument("--log-level", default="info", type=str.lower,  # (the logging module's names)
                   choices=("critical", "fatal", "error", "warning", "warn", "info", "debug", "notset"))
    return show_defaults(p)


def _mib(value: float, name: str) -> int:
    if not 0 < value < float("inf"):
        raise ConfigError(f"{name}: must be positive and finite")
    return int(value * 2**20)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    extra = {}
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"engine_option: expected KEY=VALUE, got {item!r}")
        extra[key] = value
    from transfer.options import split_pairs

    try:
        transfer_options = split_pairs(args.transfer_option)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return WorkerConfig(
        role=args.role, engine=args.engine, model=args.model, transfer=args.transfer, host=args.host,
        port=args.port, http_port=args.http_port, bootstrap=args.bootstrap,
        bootstrap_token=args.bootstrap_token if args.bootstrap_token is not None
        else os.environ.get("PD_BOOTSTRAP_TOKEN") or None, bootstrap_embedded=args.bootstrap_embedded,
        instance_id=args.instance_id, page_size=args.page_size,
        num_pages=args.num_pages, chunk_size=args.chunk_size, max_running=args.max_running,
        max_requests=args.max_requests, device=args.device, dtype=args.dtype, attention=args.attention,
        num_threads=args.num_threads,
        bootstrap_timeout_s=args.bootstrap_timeout_s, waiting_timeout_s=args.waiting_timeout_s,
        transfer_timeout_s=args.transfer_timeout_s, quarantine_timeout_s=args.quarantine_timeout_s,
        http_request_timeout_s=args.http_request_timeout_s,
        heartbeat_interval_s=args.heartbeat_interval_s, watchdog_timeout_s=args.watchdog_timeout_s,
        max_http_connections=args.max_http_connections, http_keep_alive_timeout_s=args.http_keep_alive_timeout_s,
        registry_wait_s=args.registry_wait_s, grammar_timeout_s=args.grammar_timeout_s,
        gateway_timeout_s=args.gateway_timeout_s, drain_timeout_s=args.drain_timeout_s,
        max_unread_bytes=_mib(args.max_unread_mib, "max_unread_mib"), engine_options=extra,
        advertise_host=args.advertise_host, transfer_options=transfer_options, same_host_kv=args.same_host_kv,
        api_key=_api_key(args),
    )


def _api_key(args: argparse.Namespace) -> str | None:
    from gateway.keys import one_key

    try:
        return one_key(args.api_key, args.api_key_file, "PD_WORKER_API_KEY", "api_key")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


async def _serve(config: WorkerConfig) -> None:
    from workers.worker import Worker

    worker = Worker(config)
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    assert main is not None
    stopping = False

    def stop() -> None:  # (once: a second signal must not cut the clean-up short, e.g. Ctrl-C twice)
        nonlocal stopping
        if stopping:
            if worker.end_drain():  # (a second signal during --drain-timeout-s: what is left ends now)
                log.warning("stopping now: the requests still held end shutting_down")
            else:
                log.warning("already stopping (SIGKILL ends it at once)")
            return
        stopping = True
        main.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    try:
        await worker.start()
        await worker.serve_forever()
    except asyncio.CancelledError:
        pass
    finally:
        await asyncio.shield(worker.aclose())
        _ignore_stop_signals()  # (closed: one more Ctrl-C must not turn the clean exit into a crash)


def _ignore_stop_signals() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # (a line per registry heartbeat at info: every 2 s, for ever)
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        sys.exit(f"pd-worker: bad configuration: {exc}")
    with contextlib.suppress(ImportError):
        import uvloop

        uvloop.install()
    from bootstrap.exceptions import BootstrapError
    from transfer.errors import TransferError
    from workers.addresses import AddressError

    try:
        asyncio.run(_serve(config))
        _ignore_stop_signals()  # (asyncio.run put Python's SIGINT handler back)
    except (BootstrapError, AddressError, TransferError, OSError) as exc:  # the setting or the peer named: no trace
        sys.exit(f"pd-worker: {exc}")
    except Exception as exc:
        logging.getLogger("pd-worker").exception("worker failed")
        sys.exit(f"pd-worker: {exc}")


if __name__ == "__main__":
    main()
