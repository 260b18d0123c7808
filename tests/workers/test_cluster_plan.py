"""``pd-cluster``'s plan passes addresses and transfer options through to every worker."""

from __future__ import annotations

from gateway.cluster import build_parser, plan


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
