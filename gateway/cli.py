"""``gateway``: the OpenAI-compatible PD router in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import FrameType
from typing import Any

import uvicorn

from gateway.app import GatewayConfig, create_app
from gateway.cli_help import end_by_sigint, show_defaults
from gateway.context import configure_logging
from gateway.health import HealthConfig
from gateway.http_connections import (
    GATEWAY_FD_SHARE,
    ConnectionCap,
    capped_protocol_class,
    fitted_cap,
    open_file_share,
    raise_open_file_limit,
)
from gateway.http_protocol import ClientLimits
from gateway.keys import one_key, read_keys
from gateway.metrics import ClientConnectionCollector
from transfer.netaddr import dual_stack_sockets


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prefill", action="extend", nargs="+", default=[], metavar="URL",
                   help="prefill workers, pd://HOST:PORT (ours, native) or http://HOST:PORT [BOOTSTRAP_PORT|none] "
                        "(SGLang's HTTP PD protocol; the port of its bootstrap server follows the URL) (repeatable)")
    p.add_argument("--decode", action="extend", nargs="+", default=[], metavar="URL",
                   help="decode workers, pd://HOST:PORT or http://HOST:PORT (repeatable)")
    p.add_argument("--pd-disaggregation", action="store_true",
                   help="accepted for SGLang router command lines (--prefill/--decode mean disaggregation)")
    p.add_argument("--worker", action="extend", nargs="+", default=[], metavar="URL",
                   help="combined (--role both) workers, no disaggregation")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--policy", default="round_robin",
                   help="pair-selection policy for both sides: random, round_robin, power_of_two, cache_aware, "
                        "ratio_aware, or a plugin (entry point name or module:attr)")
    p.add_argument("--prefill-policy", default=None, help="policy choosing the prefill worker (default: --policy)")
    p.add_argument("--decode-policy", default=None, help="policy choosing the decode worker (default: --policy)")
    p.add_argument("--policy-option", action="append", default=[], metavar="KEY=VALUE",
                   help="policy setting (repeatable); prefix prefill. or decode. for one side only, "
                        "e.g. cache_weight=2 or prefill.balance_factor=1.3")
    p.add_argument("--load-stale-s", type=float, default=1.0,
                   help="ignore a worker load report older than this (use the gateway's own counts)")
    p.add_argument("--assume-ttl-s", type=float, default=2.0,
                   help="how long a routed prompt counts as cached on its prefill before the worker's events")
    p.add_argument("--model-name", default=None, help="served model name (default: the workers' model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer override: 'byte' or a model directory")
    p.add_argument("--startup-timeout-s", type=float, default=60.0)
    p.add_argument("--first-token-timeout-s", type=float, default=300.0)
    p.add_argument("--stream-idle-timeout-s", type=float, default=120.0)
    p.add_argument("--request-timeout-s", type=float, default=1800.0)
    p.add_argument("--max-retries", type=int, default=2)
    p.add_argument("--max-migrations", type=int, default=2,
                   help="a stream whose decode fails after its first token continues on a new pair (prompt + "
                        "tokens so far as the new prompt) at most this often; 0 turns migration off")
    p.add_argument("--gather-ms", type=float, default=50.0,
                   help="a whole (non-streamed) response: its decode sends the tokens after the first gathered, one "
                        "output per this many ms (fewer, larger frames; with stop strings only a decode that stops "
                        "at them itself); 0: every step")
    p.add_argument("--prepare-thread-bytes", type=int, default=8192,
                   help="a request body at least this long is parsed, templated and tokenized on a thread, so "
                        "that a long prompt does not hold up the event loop (and every stream on it) for "
                        "milliseconds; 0: every request on the event loop")
    p.add_argument("--max-unread-events", type=int, default=4096,
                   help="worker events a streaming client may leave unread before its stream is stopped")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--body-timeout-s", type=float, default=60.0,
                   help="a request body must arrive within this once the gateway reads it (else 408)")
    p.add_argument("--max-header-bytes", type=int, default=64 * 1024,
                   help="largest request head (request line + headers); larger: 431")
    p.add_argument("--header-timeout-s", type=float, default=20.0,
                   help="a request head must arrive within this (else 408; also for a silent new connection)")
    p.add_argument("--write-timeout-s", type=float, default=60.0,
                   help="a client that reads nothing of its response for this long is disconnected")
    p.add_argument("--keep-alive-timeout-s", type=float, default=5.0,
                   help="a client connection idle between requests for this long is closed (uvicorn's default; "
                        "behind a load balancer, set it above the balancer's own idle timeout)")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--responses-store-max", type=int, default=1000,
                   help="/v1/responses keeps at most this many responses in this process's memory (least recently "
                        "used evicted first; not shared between gateways, lost on restart) for previous_response_id "
                        "and GET/DELETE /v1/responses/{id} (and its input_items); 0: none (store answered false, "
                        "previous_response_id a 400)")
    p.add_argument("--responses-store-max-mib", type=int, default=256,
                   help="...and at most this many MiB of them (the memory each holds: its JSON, which echoes fields "
                        "of the request, its output and its own input; least recently used evicted first)")
    p.add_argument("--responses-store-ttl-s", type=float, default=3600.0,
                   help="a stored response unused (not read nor continued) for this long is forgotten ('inf': never)")
    p.add_argument("--retry-backoff-s", type=float, default=0.05,
                   help="delay before the first retry (doubles per retry, +-50%% jitter)")
    ops = p.add_argument_group("operations")
    ops.add_argument("--max-concurrent-requests", type=int, default=0, help="requests served at once (0: no limit)")
    ops.add_argument("--max-queued-requests", type=int, default=256, help="requests waiting for a slot; more: 429")
    ops.add_argument("--max-client-connections", type=int, default=0,
                     help="client connections served at once; at the cap the one idle longest is closed for a new "
                          "one, else probes only, the rest 503 too_many_connections (0: --max-concurrent-requests "
                          "+ --max-queued-requests + 256, or with no concurrency limit three quarters of ulimit -n; "
                          "never more than those three quarters)")
    ops.add_argument("--queue-timeout-s", type=float, default=30.0, help="longest wait for a slot; then 429")
    ops.add_argument("--drain-timeout-s", type=float, default=30.0,
                     help="on SIGTERM (or a removed worker): how long open requests may finish")
    ops.add_argument("--api-key", action="append", default=[], metavar="KEY",
                     help="client API key (repeatable); requests need 'Authorization: Bearer KEY'")
    ops.add_argument("--api-key-file", default=None, help="file with one client API key per line")
    ops.add_argument("--admin-api-key", action="append", default=[], metavar="KEY",
                     help="key for the admin API (/workers ...); repeatable (without one, the client keys guard it); "
                          "$PD_ADMIN_API_KEY adds one")
    ops.add_argument("--admin-api-key-file", default=None, help="file with one admin API key per line")
    ops.add_argument("--worker-api-key", default=None, metavar="KEY",
                     help="the workers' --api-key: sent to native workers in the handshake, to SGLang (http://) "
                          "ones as 'Authorization: Bearer KEY'; default: $PD_WORKER_API_KEY")
    ops.add_argument("--worker-api-key-file", default=None, help="file holding --worker-api-key (one line)")
    ops.add_argument("--metrics-require-admin", action="store_true", help="/metrics needs the admin key")
    ops.add_argument("--cors-allow-origin", action="append", default=[], metavar="ORIGIN",
                     help="let browser pages of this origin (https://host[:port], or '*' for any) call the gateway "
                          "(CORS); repeatable; default: none")
    ops.add_argument("--health-interval-s", type=float, default=1.0, help="probe each worker this often")
    ops.add_argument("--health-timeout-s", type=float, default=2.0, help="a probe not answered by then fails")
    ops.add_argument("--unhealthy-after", type=int, default=2, help="consecutive failed probes -> unhealthy")
    ops.add_argument("--healthy-after", type=int, default=2, help="consecutive passed probes -> healthy again")
    ops.add_argument("--stall-timeout-s", type=float, default=60.0,
                     help="a worker whose scheduler made no progress this long (with requests) is unhealthy")
    ops.add_argument("--breaker-failures", type=int, default=5,
                     help="consecutive failures that open a breaker; also the fewest recent ones that open it by "
                          "--breaker-failure-rate")
    ops.add_argument("--breaker-failure-rate", type=float, default=0.5,
                     help="a breaker also opens when at least --breaker-failures of a worker's recent outcomes (about "
                          "the last 32-64) failed and they are this share of them or more; 1 = only all of them")
    ops.add_argument("--breaker-cooldown-s", type=float, default=30.0, help="open -> half-open after this")
    ops.add_argument("--breaker-successes", type=int, default=2,
                     help="half-open -> closed after this many successes; as many trials at once")
    p.add_argument("--log-level", default="info", type=str.lower,
                   choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    return show_defaults(p)


def _env_key(name: str) -> list[str]:
    """A key from the environment (a process that starts the gateway, e.g. pd-cluster, passes it that way)."""
    key = os.environ.get(name, "").strip()
    return [key] if key else []


def _worker_key(args: argparse.Namespace) -> str | None:
    return one_key(args.worker_api_key, args.worker_api_key_file, "PD_WORKER_API_KEY", "worker_api_key")


def split_prefill_args(values: list[str]) -> tuple[tuple[str, ...], tuple[int | None, ...]]:
    """SGLang's form ``--prefill URL [BOOTSTRAP_PORT|none] ...``: URLs, and each one's bootstrap port."""
    urls: list[str] = []
    ports: list[int | None] = []
    for value in values:
        if value.isdigit() or value.lower() == "none":
            if not urls or ports[-1] is not None or value == "":
                raise ValueError(f"prefill: a bootstrap port ({value}) must follow a prefill URL")
            ports[-1] = None if value.lower() == "none" else int(value)
            if ports[-1] is not None and not 0 < int(value) < 65536:
                raise ValueError(f"prefill: not a TCP port: {value}")
            continue
        urls.append(value)
        ports.append(None)
    return tuple(urls), tuple(ports)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    if not 0 <= args.port <= 65535:  # (else the listener takes it modulo 65536: 70000 listens on 4464)
        raise ValueError(f"port: not a TCP port: {args.port}")
    prefill, bootstrap_ports = split_prefill_args(args.prefill)
    return GatewayConfig(
        prefill=prefill, prefill_bootstrap_ports=bootstrap_ports if any(p is not None for p in bootstrap_ports)
        else (), decode=tuple(args.decode), worker=tuple(args.worker), host=args.host,
        port=args.port, policy=args.policy, prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        policy_options=tuple(args.policy_option), load_stale_s=args.load_stale_s, assume_ttl_s=args.assume_ttl_s,
        model_name=args.model_name, tokenizer=args.tokenizer,
        startup_timeout_s=args.startup_timeout_s, first_token_timeout_s=args.first_token_timeout_s,
        stream_idle_timeout_s=args.stream_idle_timeout_s, request_timeout_s=args.request_timeout_s,
        max_retries=args.max_retries, retry_backoff_s=args.retry_backoff_s, max_migrations=args.max_migrations,
        max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout_s,
        max_header_bytes=args.max_header_bytes, header_timeout_s=args.header_timeout_s,
        write_timeout_s=args.write_timeout_s, keep_alive_timeout_s=args.keep_alive_timeout_s,
        max_unread_events=args.max_unread_events,
        gather_s=args.gather_ms / 1000.0, prepare_thread_bytes=args.prepare_thread_bytes,
        default_max_tokens=args.default_max_tokens, responses_store_max=args.responses_store_max,
        responses_store_max_mib=args.responses_store_max_mib, responses_store_ttl_s=args.responses_store_ttl_s,
        max_concurrent_requests=args.max_concurrent_requests,
        max_queued_requests=args.max_queued_requests, max_client_connections=args.max_client_connections,
        queue_timeout_s=args.queue_timeout_s,
        drain_timeout_s=args.drain_timeout_s, api_keys=tuple(args.api_key + read_keys(args.api_key_file)),
        admin_api_keys=tuple(args.admin_api_key + read_keys(args.admin_api_key_file, "admin_api_key_file")
                             + _env_key("PD_ADMIN_API_KEY")),
        metrics_require_admin=args.metrics_require_admin, worker_api_key=_worker_key(args),
        cors_allow_origins=tuple(args.cors_allow_origin),
        health=HealthConfig(
            probe_interval_s=args.health_interval_s, probe_timeout_s=args.health_timeout_s,
            unhealthy_after=args.unhealthy_after, healthy_after=args.healthy_after,
            stall_timeout_s=args.stall_timeout_s, breaker_failures=args.breaker_failures,
            breaker_cooldown_s=args.breaker_cooldown_s, breaker_successes=args.breaker_successes,
            breaker_failure_rate=args.breaker_failure_rate,
        ),
    )


class DrainingServer(uvicorn.Server):
    """SIGTERM/SIGINT: uvicorn closes the listeners at once (new connections are refused), a request that
    arrives on a connection kept alive gets a 503 with ``Connection: close``, and open requests have up to
    ``--drain-timeout-s`` before they are cancelled (the dispatcher then aborts them on both workers). The
    process then ends by the signal it got (uvicorn raises it again: exit status 128 + its number)."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.gateway = app.state.gateway

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.gateway.begin_drain()
        super().handle_exit(sig, frame)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
        app = create_app(config)
    except (ValueError, TypeError) as exc:
        sys.exit(f"gateway: bad configuration: {exc}")
    except Exception as exc:  # plugin errors name the plugin
        sys.exit(f"gateway: {exc}")
    raise_open_file_limit()  # (before the cap is fitted to it)
    server = DrainingServer(server_config(config, app, args.log_level), app)
    try:
        server.run(dual_stack_sockets(config.host, config.port))
    except KeyboardInterrupt:  # Ctrl-C, once drained and closed (``DrainingServer``)
        end_by_sigint()


# Connections beyond the requests admission holds (idle keep-alive ones of the clients' pools, probes, scrapers)
CONNECTION_HEADROOM = 256
# Answered on a connection let in on probation at the cap (gateway/http_connections.py); the request target as
# sent, query string cut
PROBE_PATHS = frozenset((b"/health", b"/readiness", b"/metrics"))
MAX_CLIENT_CONNECTIONS = "--max-client-connections"


def client_connection_cap(config: GatewayConfig) -> int:
    """``--max-client-connections`` as applied: as given, or (0) ``--max-concurrent-requests`` +
    ``--max-queued-requests`` + ``CONNECTION_HEADROOM`` (no concurrency limit: three quarters of ``ulimit -n``); never
    more than that, so that the connections to the workers always find file descriptors."""
    cap = config.max_client_connections
    if cap == 0 and not config.max_concurrent_requests:
        return open_file_share(GATEWAY_FD_SHARE) or 1 << 20  # (no open-file limit: the cap only bounds memory)
    if cap == 0:
        cap = config.max_concurrent_requests + config.max_queued_requests + CONNECTION_HEADROOM
    return fitted_cap(cap, MAX_CLIENT_CONNECTIONS, GATEWAY_FD_SHARE)


def server_config(config: GatewayConfig, app: Any, log_level: str = "info") -> uvicorn.Config:
    """uvicorn's settings for the gateway's ``app`` (``create_app(config)``); the cap on its client connections
    reports to the app's metrics (once per app)."""
    drain_s = config.drain_timeout_s
    limits = ClientLimits(max_head_bytes=config.max_header_bytes, head_timeout_s=config.header_timeout_s,
                          body_timeout_s=config.body_timeout_s, write_timeout_s=config.write_timeout_s)
    cap = ConnectionCap(client_connection_cap(config), flag=MAX_CLIENT_CONNECTIONS, holder="the gateway",
                        probe_paths=PROBE_PATHS)
    app.state.gateway.metrics.add_collector(ClientConnectionCollector(cap))
    return uvicorn.Config(app, host=config.host, port=config.port, loop="uvloop",
                          # httptools, with limits on slow or huge heads, under a cap on the connections;
                          # generation routes on our own cycle
                          http=capped_protocol_class(limits, cap, app.hot_routes),
                          log_level=log_level.lower(), access_log=False, log_config=None,
                          timeout_keep_alive=config.keep_alive_timeout_s,  # type: ignore[arg-type]
                          proxy_headers=False,  # nothing reads the client address; saves a pass per request
                          # (the drain timeout as given, not rounded to whole seconds; inf: no limit)
                          timeout_graceful_shutdown=drain_s if math.isfinite(drain_s) else None)  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
