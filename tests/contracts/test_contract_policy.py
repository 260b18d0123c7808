"""The policy contract (gateway.policies.contract) for every built-in policy and the example plugin,
and proof that each check catches the bug it is there for."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.policies import Pair, create_policy, load_policy_class
from gateway.policies.contract import CHECKS, run_contract
from gateway.policies.loader import option_names

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "pd-policy-sticky"
BUILTINS = ["random", "round_robin", "power_of_two", "cache_aware", "ratio_aware"]


def factory_for(name: str) -> Callable[[], object]:
    options = {"seed": "1"} if "seed" in option_names(load_policy_class(name)) else {}
    return lambda: create_policy(name, options)


def example_factory() -> Callable[[], object]:
    sys.path.insert(0, str(EXAMPLE))
    try:
        from pd_policy_sticky import StickyPrefixPolicy
    finally:
        sys.path.remove(str(EXAMPLE))
    return StickyPrefixPolicy


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("name", [*BUILTINS, "example:sticky_prefix"])
def test_policy_passes_the_contract(name: str, check: str) -> None:
    factory = example_factory() if name.startswith("example:") else factory_for(name)
    CHECKS[check](factory)  # type: ignore[arg-type]


# -- each check can fail ---------------------------------------------------------------------------
class Foreign:
    """Returns a worker of its own making."""

    name = "foreign"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        return Pair(prefills[0] if prefills else None, type(decodes[0])("pd://elsewhere:1", "decode"))


class Sticky:
    """Remembers the first decode forever (even once it left the pool)."""

    name = "sticky"

    def __init__(self) -> None:
        self.decode = None

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        self.decode = self.decode or decodes[0]
        return Pair(prefills[0] if prefills else None, self.decode)


class AlwaysPrefill:
    """Forgets combined mode: returns a prefill that does not exist."""

    name = "always_prefill"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        return Pair(prefills[0] if prefills else decodes[0], decodes[0])


class Unseeded:
    name = "unseeded"

    def __init__(self) -> None:
        self.rng = random.Random()

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        return Pair(self.rng.choice(prefills) if prefills else None, self.rng.choice(decodes))


class Quadratic:
    """Compares every pair of decodes."""

    name = "quadratic"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        best = min(decodes, key=lambda d: sum(abs(d.num_free_pages - e.num_free_pages) for e in decodes))
        return Pair(prefills[0] if prefills else None, best)


class BadHook:
    name = "bad_hook"

    def select(self, prefills, decodes, request):  # type: ignore[no-untyped-def]
        return Pair(prefills[0] if prefills else None, decodes[0])

    def on_finish(self, pair, request):  # type: ignore[no-untyped-def]  # misses ``outcome``
        pass


@pytest.mark.parametrize(("policy", "check"), [
    (Foreign, "returns_members"), (Sticky, "never_unhealthy"), (AlwaysPrefill, "combined_mode"),
    (Unseeded, "deterministic"), (Quadratic, "bounded_cost"), (BadHook, "hooks_accept_calls"),
])
def test_each_check_catches_its_bug(policy: type, check: str) -> None:
    with pytest.raises(Exception):  # noqa: B017 - any failure counts; the message is checked below
        CHECKS[check](policy)
    assert any(line.startswith(f"{check}:") for line in run_contract(policy))
