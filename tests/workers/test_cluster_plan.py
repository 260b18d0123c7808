"""``pd-cluster``'s plan (no process started): addresses and transfer options reach every worker; ports it
was told to use must be free (else whatever listens there would pass its child's health checks), IPv6 hosts
are bracketed in every URL, log levels are ones every child takes, and the registry is told the level too."""

from __future__ import annotations

import socket

import pytest

from gateway.cluster import build_parser, free_port, plan


def _flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == name]


def test_addresses_and_transfer_options_reach_the_workers() -> None:
    args = build_parser().parse_args(["--engine", "sim", "--host", "0.0.0.0", "--advertise-host", "127.0.0.1",
                                      "--transfer", "nixl", "--transfer-option", "ucx_tls=tcp",
                                      "--transfer-option", "ucx_num_workers=2"])
    children = plan(args)
    workers = [c for c in children if c.name.startswith(("prefill", "decode"))]
    assert len(workers) == 2
    for child in workers:
        assert _flag(child.argv, "--host") == ["0.0.0.0"]
        assert _flag(child.argv, "--advertise-host") == ["127.0.0.1"]
        assert _flag(child.argv, "--transfer-option") == ["ucx_tls=tcp", "ucx_num_workers=2"]
        assert _flag(child.argv, "--bootstrap")[0].startswith("http://127.0.0.1:")
    gateway = children[-1]
    assert all(url.startswith("pd://127.0.0.1:") for url in gateway.argv if url.startswith("pd://"))


def test_a_wildcard_host_is_reached_on_loopback_by_default() -> None:
    args = build_parser().parse_args(["--engine", "sim", "--host", "0.0.0.0"])
    children = plan(args)
    assert all("--advertise-host" not in c.argv for c in children)
    assert children[0].health_url.startswith("http://127.0.0.1:")


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


def test_one_port_for_the_gateway_and_the_registry_is_refused_before_anything_starts() -> None:
    port = str(free_port())
    with pytest.raises(RuntimeError, match="--port and --bootstrap-port are both"):
        plan(build_parser().parse_args(["--engine", "sim", "--port", port, "--bootstrap-port", port]))


@pytest.mark.parametrize("module", ["gateway.cli", "workers.cli"])
def test_an_unknown_log_level_is_a_usage_error(module: str) -> None:
    """(It was a traceback from the logging module or uvicorn once the process was set up.)"""
    import importlib

    parser = importlib.import_module(module).build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "bogus"])


def test_a_probe_answered_by_something_that_is_not_http_is_a_failed_probe() -> None:
    """Another program on a child's port (it answers, not in HTTP): one failed liveness check, not a traceback
    out of the supervisor that stopped the whole cluster."""
    import threading

    from gateway.cluster import _probe

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")

        thread = threading.Thread(target=answer, daemon=True)
        thread.start()
        assert _probe(f"http://127.0.0.1:{server.getsockname()[1]}/health", 2) == "failed"
        thread.join(5)


def test_a_bracketed_ipv6_host_is_taken_as_the_bare_address() -> None:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::", 0))
    except OSError:
        pytest.skip("no IPv6 here")
    children = plan(build_parser().parse_args(["--engine", "sim", "--host", "[::]", "--port", str(free_port())]))
    assert all(_flag(c.argv, "--host") == ["::"] for c in children if "--host" in c.argv)


def test_the_no_proxy_hosts_join_what_either_spelling_gave(monkeypatch: pytest.MonkeyPatch) -> None:
    """(With only NO_PROXY set, a new no_proxy held just the cluster's hosts: the user's went through the proxy,
    urllib and httpx reading the lowercase one first.)"""
    import os
    import urllib.request

    from gateway.cluster import _no_proxy_for

    monkeypatch.setenv("no_proxy", "")  # (recorded, so that what the call writes is undone after the test)
    monkeypatch.setenv("NO_PROXY", "corp.internal")
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    _no_proxy_for("127.0.0.1", "10.0.0.5")

    for name in ("no_proxy", "NO_PROXY"):
        assert os.environ[name].split(",") == ["corp.internal", "127.0.0.1", "10.0.0.5"]
    assert urllib.request.proxy_bypass("corp.internal")


def test_a_port_whose_last_connections_linger_in_time_wait_is_free() -> None:
    """After the cluster's own stop, its port holds TIME_WAIT connections (its liveness probes close theirs):
    the servers bind with SO_REUSEADDR and would start, but the plan's check said "the port is in use" for up
    to a minute (found by review)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = server.accept()
        accepted.close()  # (the server side closes first: its end waits in TIME_WAIT)
        client.close()
    children = plan(build_parser().parse_args(["--engine", "sim", "--port", str(port)]))
    assert any(f"{port}" in arg for arg in children[-1].argv)


def test_children_args_reach_their_children_last() -> None:
    """``--worker-arg`` / ``--gateway-arg`` go to every worker / the gateway as they are, after pd-cluster's own
    (so that one may also override a setting pd-cluster makes)."""
    args = build_parser().parse_args(["--engine", "sim", "--worker-arg=--grammar-timeout-s=10",
                                      "--worker-arg=--max-http-connections=100",
                                      "--gateway-arg=--max-client-connections=2048"])
    children = plan(args)
    workers = [c for c in children if c.name.startswith(("prefill", "decode"))]
    for child in workers:
        assert child.argv[-2:] == ["--grammar-timeout-s=10", "--max-http-connections=100"]
    assert children[-1].name == "gateway" and children[-1].argv[-1] == "--max-client-connections=2048"
    assert all("--max-client-connections=2048" not in c.argv for c in workers)
