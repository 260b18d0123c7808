"""``gateway``: the OpenAI-compatible PD router in front of prefill and decode workers."""

from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from gateway.app import GatewayConfig, create_app


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gateway", description=__doc__)
    p.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill workers, pd://HOST:PORT")
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode workers, pd://HOST:PORT")
    p.add_argument("--worker", nargs="+", default=[], metavar="URL",
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
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument("--log-level", default="info")
    return p


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        prefill=tuple(args.prefill), decode=tuple(args.decode), worker=tuple(args.worker), host=args.host,
        port=args.port, policy=args.policy, prefill_policy=args.prefill_policy, decode_policy=args.decode_policy,
        policy_options=tuple(args.policy_option), load_stale_s=args.load_stale_s, assume_ttl_s=args.assume_ttl_s,
        model_name=args.model_name, tokenizer=args.tokenizer,
        startup_timeout_s=args.startup_timeout_s, first_token_timeout_s=args.first_token_timeout_s,
        stream_idle_timeout_s=args.stream_idle_timeout_s, request_timeout_s=args.request_timeout_s,
        max_retries=args.max_retries, max_body_bytes=args.max_body_bytes,
        default_max_tokens=args.default_max_tokens,
    )


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
        app = create_app(config)
    except (ValueError, TypeError) as exc:
        sys.exit(f"gateway: bad configuration: {exc}")
    except Exception as exc:  # plugin errors name the plugin
        sys.exit(f"gateway: {exc}")
    uvicorn.run(app, host=config.host, port=config.port, loop="uvloop", http="httptools",
                log_level=args.log_level.lower(), access_log=False, timeout_graceful_shutdown=5)


if __name__ == "__main__":
    main()
