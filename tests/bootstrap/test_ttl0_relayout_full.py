"""Under ``--ttl-s 0`` a new layout supersedes the previous run's ranks (``Registry.register``): the capacity
check must count the ranks it drops as freed, or a registry sized for one instance refuses its restart
(503 registry_full) for ever, the old ranks never expiring."""

from __future__ import annotations

from bootstrap.errors import ApiError
from bootstrap.registry import Registry
from tests.bootstrap.test_ttl0_relayout import sglang_put


def test_a_new_layout_is_not_refused_as_full_by_the_ranks_it_supersedes() -> None:
    reg = Registry(ttl_s=0, max_ranks=4)
    # the previous run: tp 2 x pp 2, registered once at start-up
    for i, (tp, pp) in enumerate([(0, 0), (0, 1), (1, 0), (1, 1)]):
        reg.register(sglang_put(attn_tp_size=2, attn_tp_rank=tp, pp_size=2, pp_rank=pp, rank_port=5000 + i),
                     {}, now=0.1 * i)
    # restarted as tp 4 (pp 1): its rank 2 happens to PUT first, a key the old layout does not have
    try:
        reg.register(sglang_put(attn_tp_size=4, attn_tp_rank=2, rank_port=6002), {}, now=3600.0)
    except ApiError as exc:
        raise AssertionError(f"refused ({exc.status} {exc.code}): {exc.message}") from None
    for tp in (0, 1, 3):
        reg.register(sglang_put(attn_tp_size=4, attn_tp_rank=tp, rank_port=6000 + tp), {}, now=3600.1)
    assert reg.num_ranks == 4
    instance = reg.find_instance(None, 3600.2)
    assert reg.lookup(instance, (0, 0, 2, 0)).rank_port == 6002
