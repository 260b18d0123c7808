"""The draining mark of a rank registered without a ``registrant`` (SGLang-style, or ``RankRegistration`` as
docs/bootstrap.md's example builds it, with a fixed port): nothing tells its processes apart, so the mark must not
stick to the next process on the same address. A drained prefill SIGKILLed before its goodbye (the grace period
ran out) and restarted on its fixed port is a healthy prefill: it must not be listed as leaving for as long as it
lives (and taken over at once by any other registrant)."""

from __future__ import annotations

from typing import Any

import msgspec
from conftest import rank_body

from bootstrap.messages import RankPut
from bootstrap.registry import Registry


def put(**kw: Any) -> RankPut:
    return msgspec.convert(rank_body(**kw), RankPut)


def test_a_restart_on_the_same_address_without_a_registrant_is_not_left_draining() -> None:
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(instance_id="p"), {}, now=0.0)
    reg.register(put(instance_id="p", draining=True), {}, now=1.0)  # draining; then killed before its goodbye
    assert reg.find_instance("p", now=1.5).is_draining
    reg.register(put(instance_id="p"), {}, now=3.0)  # the restarted process, same address, healthy
    reg.register(put(instance_id="p"), {}, now=5.0)
    inst = reg.find_instance("p", now=6.0)
    assert not inst.is_draining and not inst.entries[(0, 0, 0, 0)].draining


def test_an_sglang_prefill_restarted_over_a_marked_draining_rank_is_not_left_draining() -> None:
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(instance_id="p", draining=True), {"registrant": "old"}, now=0.0)
    reg.register(put(instance_id="p"), {}, now=1.0)  # (no registrant: SGLang's prefill on the same address)
    assert not reg.find_instance("p", now=2.0).is_draining


def test_a_marked_renewal_from_before_the_drain_still_does_not_undo_it() -> None:
    """(What the stickiness is for, kept where the registrant tells the process)"""
    reg = Registry(ttl_s=10, max_ranks=10)
    reg.register(put(instance_id="p", draining=True), {"registrant": "a"}, now=0.0)
    reg.register(put(instance_id="p"), {"registrant": "a"}, now=1.0)
    assert reg.find_instance("p", now=2.0).is_draining
