"""``--drain-timeout-s`` is how long open requests may finish after SIGTERM, as given: uvicorn's graceful shutdown
got it rounded to whole seconds, at least 1 (0.3 drained for 1 s, 2.5 for 2 s), and ``inf`` (no limit) stopped the
gateway at start with an ``OverflowError`` traceback."""

from __future__ import annotations

import math

import pytest

from gateway.app import create_app
from gateway.cli import build_parser, config_from_args, server_config


@pytest.mark.parametrize(("given", "expected"), [("0.3", 0.3), ("2.5", 2.5), ("30", 30.0), ("inf", None)])
def test_the_server_drains_for_the_drain_timeout_given(given: str, expected: float | None) -> None:
    args = build_parser().parse_args(["--prefill", "pd://127.0.0.1:1", "--decode", "pd://127.0.0.1:2",
                                      "--drain-timeout-s", given])
    config = config_from_args(args)
    assert math.isclose(config.drain_timeout_s, float(given))
    timeout = server_config(config, create_app(config)).timeout_graceful_shutdown
    assert timeout == expected
