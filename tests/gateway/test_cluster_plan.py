"""``pd-cluster``'s plan (no process started): ports it was told to use must be free (else whatever
listens there would pass its child's health checks), IPv6 hosts in brackets in every URL, log levels
every child takes, and the registry told the level too."""

from __future__ import annotations

import socket

import pytest

from gateway.cluster import build_parser, plan


def test_a_port_in_use_fails_the_plan_naming_it() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for flag in ("--port", "--bootstrap-port"):
            with pytest.raises(RuntimeError, match=f"{flag} {port}: the port is in use"):
                plan(build_parser().parse_args(["--engine", "sim", flag, str(port)]))


def test_ipv6_hosts_are_bracketed_in_every_url() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    children = plan(build_parser().parse_args(["--engine", "sim", "--host", "::1", "--port", "0"]))
    urls = [c.health_url for c in children] + [arg for c in children for arg in c.argv if "://" in arg]
    assert urls and all("://[::1]:" in url for url in urls), urls


def test_log_levels_are_the_ones_every_child_takes() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--log-level", "trace"])
    children = plan(build_parser().parse_args(["--engine", "sim", "--log-level", "INFO"]))
    assert all(c.argv[c.argv.index("--log-level") + 1] == "info" for c in children)  # (the registry's too)
