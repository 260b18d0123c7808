"""Wire messages of the bootstrap registry (JSON over HTTP, SGLang-compatible field names).

Field names and meanings follow SGLang's bootstrap server and its decode-side reader
(python/sglang/srt/disaggregation/common/conn.py: ``register_to_bootstrap``,
``try_ensure_parallel_info`` and ``PrefillServerInfo``). ``instance_id`` and ``draining`` in ``RankPut`` are our
extensions; everything else is SGLang's shape.

A real SGLang decode builds ``PrefillServerInfo(**topology_json)``: the topology reply must hold
exactly the fields of ``Topology`` and nothing else, or it raises ``TypeError``.
"""

from __future__ import annotations

import msgspec

DEFAULT_INSTANCE_ID = "default"
DEFAULT_BOOTSTRAP_PORT = 8998
FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"


class RankPut(msgspec.Struct, kw_only=True):
    """The body of ``PUT /route`` (and of our ``DELETE /route``): one prefill rank's registration."""

    attn_tp_size: int
    attn_tp_rank: int
    attn_cp_size: int
    attn_cp_rank: int
    attn_dp_size: int
    attn_dp_rank: int
    pp_size: int
    pp_rank: int
    system_dp_size: int
    system_dp_rank: int
    rank_ip: str
    rank_port: int
    page_size: int
    kv_cache_dtype: str
    load_balance_method: str = FOLLOW_BOOTSTRAP_ROOM
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None
    instance_id: str | None = None
    # Ours: the rank is draining (its worker got SIGTERM with a drain timeout). Look-ups still answer its address,
    # for the rooms it holds; listings flag it as leaving. Our registry answers such a PUT ``{"draining": true}``
    # (JSON) instead of ``OK``: a registrar that does not get it back knows the registry ignored the field.
    draining: bool = False


RANK_PUT_FIELDS = frozenset(RankPut.__struct_fields__)


class Topology(msgspec.Struct, frozen=True):
    """The reply to ``GET /route`` with all four ranks ``-1`` (SGLang's ``PrefillServerInfo``)."""

    attn_tp_size: int
    attn_cp_size: int
    dp_size: int
    pp_size: int
    page_size: int | None
    kv_cache_dtype: str | None
    follow_bootstrap_room: bool
    enable_dsa_cache_layer_split: bool = False
    prefill_http_port: int | None = None

    @property
    def num_ranks(self) -> int:
        return self.dp_size * self.attn_cp_size * self.attn_tp_size * self.pp_size


class RankAddress(msgspec.Struct, frozen=True):
    """The reply to a concrete ``GET /route``: the rank's KV control endpoint (SGLang's ``PrefillRankInfo``)."""

    rank_ip: str
    rank_port: int


class RegisterDpRank(msgspec.Struct):
    """The body of ``POST /register_dp_rank``."""

    bootstrap_room: int
    dp_rank: int


class QueryDpRanks(msgspec.Struct):
    """The body of ``POST /query_dp_ranks``; the reply is ``{str(room): dp_rank}`` for known rooms only."""

    bootstrap_rooms: list[int]


class ErrorDetail(msgspec.Struct, omit_defaults=True):
    message: str
    type: str
    code: str
    # Seconds until a retry can succeed, where the registry knows (a 409 ``instance_conflict``: until the holder's
    # lease stops counting as live); absent otherwise. The reply's ``Retry-After`` header says it rounded up.
    retry_after_s: float | None = None


class ErrorBody(msgspec.Struct):
    """Every error reply: ``{"error": {"message", "type", "code"}}``."""

    error: ErrorDetail
