"""How policies are named and configured: a ``module:Class`` plugin from the working directory (as the docs and
the contract runner have it), options that would change nothing refused, a misspelled ``--policy`` refused even
when both sides override it, and the contract runner's answer for a policy it cannot build. Found by review."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from gateway.policies.contract import main as contract_main
from gateway.policies.loader import PolicyError
from gateway.router import Router
from gateway.runtime import Gateway, GatewayConfig
from workers.plugins import PluginError, load_plugin

PLUGIN = """
from gateway.policies.base import Pair

class LeastQueued:
    name = "least_queued"

    def select(self, prefills, decodes, request):
        return Pair(min(prefills, key=lambda w: w.num_active) if prefills else None,
                    min(decodes, key=lambda w: w.num_active))
"""


def test_a_module_colon_class_policy_is_found_in_the_working_directory(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed ``gateway`` command does not look in the working directory (``python -m`` does): a plugin
    that passed its contract run in its project's directory was "No module named ..." to the gateway."""
    package = tmp_path / "review_plugin_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "policy.py").write_text(textwrap.dedent(PLUGIN))
    (package / "broken.py").write_text("import a_module_that_is_not_installed_anywhere\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        cls = load_plugin("pd_gateway.policies", "review_plugin_pkg.policy:LeastQueued")
        assert cls.name == "least_queued"
        assert contract_main(["review_plugin_pkg.policy:LeastQueued"]) == 0
        with pytest.raises(PluginError, match="a_module_that_is_not_installed_anywhere"):  # (its own import error)
            load_plugin("pd_gateway.policies", "review_plugin_pkg.broken:X")
        with pytest.raises(PluginError, match="no_such_package_here"):
            load_plugin("pd_gateway.policies", "no_such_package_here.policy:X")
    finally:
        for name in [m for m in sys.modules if m.startswith("review_plugin_pkg")]:
            del sys.modules[name]


def test_a_misspelled_policy_is_refused_even_when_both_sides_override_it() -> None:
    config = GatewayConfig(prefill=("pd://127.0.0.1:11",), decode=("pd://127.0.0.1:21",), policy="no_such_policy",
                           prefill_policy="random", decode_policy="random")
    with pytest.raises(PluginError, match="no_such_policy"):
        Gateway(config)


def test_options_that_change_nothing_on_the_decode_side_are_refused() -> None:
    """``cache_aware`` picks its decode by pressure alone: ``decode.cache_weight`` was taken, changed no decision,
    and split the joint instance (its metrics renamed)."""
    with pytest.raises(PolicyError, match=r"decode\.cache_weight"):
        Router.build("cache_aware", "cache_aware", {"decode": {"cache_weight": "50"}})
    with pytest.raises(PolicyError, match=r"decode\.fill_window"):
        Router.build("random", "cache_aware", {"decode": {"fill_window": "4"}})
    assert not Router.build("cache_aware", "cache_aware", {"prefill": {"cache_weight": "5"}}).is_joint
    assert Router.build("cache_aware", "cache_aware", {"": {"cache_weight": "5"}}).is_joint  # (shared: both sides)


def test_the_contract_runner_says_why_it_cannot_build_a_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert contract_main(["no_such_policy"]) == 2
    assert "cannot build the policy" in capsys.readouterr().err
    assert contract_main(["cache_aware", "cache_weight=-1"]) == 2
    assert "cache_weight" in capsys.readouterr().err
    assert contract_main(["round_robin"]) == 0
    assert "round_robin: 8/8 checks passed" in capsys.readouterr().out


def test_a_worker_added_again_under_another_spelling_during_its_drain_leaves_no_index_entry() -> None:
    """The drain takes the worker out of the pools, then closes it; the admin API adding the same address spelled
    otherwise (``127.0.0.1:11`` for ``pd://127.0.0.1:11``) in that window made both clean-ups skip the old URL,
    whose place and pages then stayed in the prefix index for good (keyed by URL string, not by address)."""
    import asyncio
    import os

    from test_hot_path import _RecordingTransport

    from workers.protocol import PROTOCOL_VERSION, HelloAck, KVEvents

    async def run() -> None:
        gw = Gateway(GatewayConfig(prefill=("pd://127.0.0.1:11", "pd://127.0.0.1:12"), decode=("pd://127.0.0.1:21",),
                                   policy="cache_aware", drain_timeout_s=1.0))
        loop = asyncio.get_running_loop()
        for i, client in enumerate(gw.clients):
            client.loop = loop
            client._transport = _RecordingTransport()  # type: ignore[assignment]
            boot = ("127.0.0.1", 9000 + i, f"inst{i}") if client.role == "prefill" else (None, None, None)
            client.info = HelloAck(PROTOCOL_VERSION, f"w{i}", client.role, "sim", "m", "byte", 4, 4096, 64, *boot)
            client.state.connected(client.info)
            client._announce(True)
        old = gw.prefills[0]
        old.on_kv_events(old, KVEvents(stored=[os.urandom(16) for _ in range(100)], reset=True))
        old._task = asyncio.create_task(asyncio.sleep(3600))  # its connection: ``aclose`` awaits its end
        gw.remove_worker(old.url)
        drain = next(iter(gw._tasks))
        while old in gw.prefills:  # the drain has taken it out of the pools and is closing it
            await asyncio.sleep(0)
        new = gw.add_worker("127.0.0.1:11", "prefill")
        await drain
        index = gw.router.index
        assert old.url not in index._bit_of and not index._held
        assert new.url != old.url
        for client in gw.clients:
            if client._task is not None:
                client._task.cancel()

    asyncio.run(run())
