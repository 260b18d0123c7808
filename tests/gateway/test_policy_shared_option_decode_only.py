"""An unprefixed ``--policy-option`` goes to every policy that declares it. When only the decode side's policy
declares it, and that policy picks its decode without it (``decode_options``: ``cache_aware``'s prefill knobs),
it changes nothing: ``--prefill-policy round_robin --decode-policy cache_aware --policy-option cache_weight=4``
started, and routed exactly as without the option, while the same option spelled ``decode.cache_weight=4`` is
refused at start-up as changing nothing."""

from __future__ import annotations

import pytest

from gateway.policies.loader import PolicyError
from gateway.router import Router


@pytest.mark.parametrize("prefill", ["round_robin", "power_of_two", "random"])
def test_a_shared_option_only_the_decode_side_takes_and_ignores_is_refused(prefill: str) -> None:
    with pytest.raises(PolicyError, match=r"cache_weight"):
        Router.build(prefill, "cache_aware", {"": {"cache_weight": "4"}})
    with pytest.raises(PolicyError, match=r"fill_window"):
        Router.build(prefill, "cache_aware", {"": {"fill_window": "4"}})


def test_shared_options_that_matter_somewhere_are_still_taken() -> None:
    assert Router.build("cache_aware", "cache_aware", {"": {"cache_weight": "5"}}).is_joint
    split = Router.build("cache_aware", "round_robin", {"": {"cache_weight": "5"}})
    assert split.prefill_policy.options.cache_weight == 5.0  # type: ignore[attr-defined]
    both = Router.build("power_of_two", "random", {"": {"seed": "3"}})  # (a decode option that matters)
    assert not both.is_joint
