"""With leases off (``--ttl-s 0``, what the docs prescribe for SGLang prefills, which register once and
never heartbeat nor deregister), an instance restarted with a new layout must be accepted: its old ranks can
neither expire nor deregister, so refusing the new layout "until they expire or deregister" refuses it for
ever, and decodes keep being handed the dead process's topology and addresses."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from bootstrap.errors import ApiError
from bootstrap.messages import RankPut
from bootstrap.registry import Registry


def sglang_put(**kw: Any) -> RankPut:
    body: dict[str, Any] = {
        "attn_tp_size": 2, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
        "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
        "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": "10.0.0.1", "rank_port": 5000,
        "page_size": 64, "kv_cache_dtype": "auto", "load_balance_method": "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": False, "prefill_http_port": 30000,
    }
    body.update(kw)
    return msgspec.convert(body, RankPut)


@pytest.mark.parametrize("change", [{"prefill_http_port": 30001}, {"page_size": 16}, {"kv_cache_dtype": "fp8_e4m3"}])
def test_an_sglang_prefill_restarted_with_new_flags_registers_under_ttl_0(change: dict[str, Any]) -> None:
    reg = Registry(ttl_s=0, max_ranks=100)
    # the first SGLang prefill (tp 2) registers once, at start-up, and never again
    reg.register(sglang_put(attn_tp_rank=0, rank_port=5000), {}, now=0.0)
    reg.register(sglang_put(attn_tp_rank=1, rank_port=5001), {}, now=0.1)
    # an hour later it is restarted with one flag changed: each rank PUTs once (SGLang retries 5 times, ~15 s)
    try:
        reg.register(sglang_put(attn_tp_rank=0, rank_port=6000, **change), {}, now=3600.0)
        reg.register(sglang_put(attn_tp_rank=1, rank_port=6001, **change), {}, now=3600.1)
    except ApiError as exc:
        pytest.fail(f"the restarted prefill is refused ({exc.status} {exc.code}): {exc.message}")
    instance = reg.find_instance(None, 3600.2)
    assert reg.lookup(instance, (0, 0, 0, 0)).rank_port == 6000
    assert reg.lookup(instance, (0, 0, 1, 0)).rank_port == 6001


def test_mixed_flags_among_ranks_registering_together_are_still_refused_under_ttl_0() -> None:
    reg = Registry(ttl_s=0, max_ranks=100)
    reg.register(sglang_put(attn_tp_rank=0, rank_port=5000), {}, now=0.0)
    with pytest.raises(ApiError) as err:  # (a rank of the same start-up that disagrees: a misconfiguration)
        reg.register(sglang_put(attn_tp_rank=1, rank_port=5001, page_size=16), {}, now=1.0)
    assert err.value.status == 409
