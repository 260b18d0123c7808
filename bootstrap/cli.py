"""``pd-bootstrap``: run the bootstrap registry as its own service (flags mirror ``BootstrapConfig``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

import uvicorn

from bootstrap.app import create_app, guarded_http
from bootstrap.config import BootstrapConfig
from gateway.cli_help import end_by_sigint
from transfer.netaddr import dual_stack_sockets

TOKEN_ENV = "PD_BOOTSTRAP_TOKEN"


def parse_args(argv: Sequence[str] | None = None) -> BootstrapConfig:
    d = BootstrapConfig()
    p = argparse.ArgumentParser(prog="pd-bootstrap", description="Bootstrap registry for prefill/decode workers",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--host", default=d.host, help="bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=d.port, help="bind port (default %(default)s, SGLang's)")
    p.add_argument(
        "--ttl-s",
        type=float,
        default=d.ttl_s,
        help="a rank expires this long after its last PUT /route; 0 = never (default %(default)s)",
    )
    p.add_argument(
        "--token", default=None, help=f"shared bearer token (or set ${TOKEN_ENV}); /health always stays open"
    )
    p.add_argument(
        "--token-scope",
        choices=["all", "writes"],
        default=d.token_scope,
        help="'all': every route but /health needs the token; 'writes': only PUT/DELETE /route and "
        "/register_dp_rank (SGLang's policy, lets unmodified SGLang decodes read)",
    )
    p.add_argument(
        "--room-ttl-s",
        type=float,
        default=d.room_ttl_s,
        help="lifetime of a /register_dp_rank entry (default %(default)s)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=d.max_body_bytes,
        help="larger request bodies get 413 (default %(default)s)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=float,
        default=d.body_timeout_s,
        help="a request body must arrive within this, else 408 (default %(default)s)",
    )
    p.add_argument("--max-rooms", type=int, default=d.max_rooms, help="room table capacity (default %(default)s)")
    p.add_argument("--max-ranks", type=int, default=d.max_ranks, help="rank capacity (default %(default)s)")
    p.add_argument(
        "--log-level", default=d.log_level, choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="(default %(default)s)",
    )
    args = p.parse_args(argv)
    token = args.token if args.token is not None else os.environ.get(TOKEN_ENV) or None
    try:
        return BootstrapConfig(
            host=args.host,
            port=args.port,
            ttl_s=args.ttl_s,
            token=token,
            token_scope=args.token_scope,
            room_ttl_s=args.room_ttl_s,
            max_body_bytes=args.max_body_bytes,
            body_timeout_s=args.body_timeout_s,
            max_rooms=args.max_rooms,
            max_ranks=args.max_ranks,
            log_level=args.log_level,
        )
    except ValueError as exc:
        p.error(str(exc))
        raise  # unreachable: p.error exits


def main(argv: Sequence[str] | None = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(
        level=config.log_level.upper() if config.log_level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    server = uvicorn.Server(uvicorn.Config(
        create_app(config),
        host=config.host,
        port=config.port,
        log_level=config.log_level,
        access_log=False,
        lifespan="on",
        loop="uvloop",
        http=guarded_http(),
        timeout_graceful_shutdown=5,
    ))
    try:
        server.run(dual_stack_sockets(config.host, config.port))
    except KeyboardInterrupt:  # Ctrl-C, once the server has closed
        end_by_sigint()
    if not server.started:  # (as ``uvicorn.run``: a port in use, say)
        sys.exit(3)


if __name__ == "__main__":
    main()
