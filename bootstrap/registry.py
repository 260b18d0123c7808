"""The rank registry: prefill instances, their ranks, leases and readiness. Pure state, no I/O.

Lifecycle (all calls come from the server's single event loop; none blocks or awaits):
1. ``register(put, extra, now)`` validates a ``PUT /route`` body and stores or refreshes the rank
   under its instance (``put.instance_id``, absent = ``"default"``). Every PUT renews the rank's
   lease to ``now + ttl_s``; a PUT for a key that is already held replaces its address (worker
   restart). A PUT whose topology contradicts other live ranks of the instance is refused (409).
   The registry never mutates on a refused PUT.
2. ``find_instance`` / ``topology`` / ``lookup`` answer ``GET /route``. An instance is ready when
   every one of its dp x cp x tp x pp ranks holds a live lease; until then both kinds of query
   raise 503, so a decode never gets the address of a half-registered or dead instance.
3. Expired leases are dropped lazily on every read of their instance, and by ``sweep(now)``,
   which the server calls periodically. An instance whose last rank expired is forgotten,
   topology included, so it can come back with a different layout.
4. A PUT with ``draining`` set (a prefill stopping with a drain timeout, re-sent on each renewal) marks its rank
   draining: ``lookup``/``topology`` still answer it (decodes holding rooms for it must find it), the listing flags
   it and its instance (``Instance.is_draining``) as leaving. The mark sticks while the same process (address and
   ``registrant``; an unmarked entry's, until a plain PUT) holds the rank; another process registering the rank
   takes it over at once (a draining holder does not hold off its successor), and a draining PUT never takes a rank
   back from another holder (409).
5. ``deregister(put, now, extra)`` drops a rank on graceful shutdown (at the end of the drain, if any), only if it is
   still the sender's: its address still matches and, when the goodbye carries a ``registrant`` mark, so does the
   entry's (a late goodbye from an old process cannot remove its replacement, also one restarted on the same address).
   A goodbye that names its ``registrant`` is final: the registry keeps a tombstone of (instance, rank, registrant)
   (``bootstrap.tombstones``) for ``max(ttl_s, TOMBSTONE_MIN_S, --body-timeout-s)``, at most ``MAX_TOMBSTONES`` of
   them, and ``register`` refuses that registrant's later PUTs of the rank with 410 ``deregistered`` (a renewal sent
   before the goodbye and arriving after it would otherwise bring the entry back, until its lease ends, or for ever
   with ``ttl_s`` 0). Another process (another ``registrant``, or none: SGLang's) registering the rank is not affected.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from bootstrap import errors
from bootstrap.messages import DEFAULT_INSTANCE_ID, FOLLOW_BOOTSTRAP_ROOM, RankAddress, RankPut, Topology
from bootstrap.tombstones import Tombstones

logger = logging.getLogger("bootstrap")

RankKey = tuple[int, int, int, int]  # (dp_group, cp_rank, tp_rank, pp_rank)

MAX_PARALLEL_SIZE = 65_536
_INSTANCE_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@/-]{0,127}$")
_MAX_TEXT = 255
_LABEL_RE = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")  # one label of a host name
# an IPv6 zone: an interface name (at most IFNAMSIZ - 1 = 15 bytes) or its index; ``ipaddress`` takes any text
_SCOPE_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,14}")
_NUMBER_RE = re.compile(r"[0-9]+|0[xX][0-9A-Fa-f]*")  # a part of an address in inet_aton's notations
MAX_PAGE_SIZE = 1 << 20


@dataclass
class RankEntry:
    """One registered rank and its lease."""

    key: RankKey
    address: RankAddress
    extra: dict[str, Any]
    first_seen: float  # monotonic
    last_seen: float  # monotonic
    expires_at: float  # monotonic; inf when leases never expire
    registered_unix: float
    num_puts: int = 1
    draining: bool = False  # the rank's process is stopping: still looked up, routed nothing new


@dataclass
class Instance:
    """One prefill instance: its topology (first accepted rank's) and its ranks."""

    instance_id: str
    topology: Topology
    entries: dict[RankKey, RankEntry] = field(default_factory=dict)
    next_expiry: float = math.inf  # lower bound of min(entry.expires_at)

    @property
    def is_ready(self) -> bool:
        return len(self.entries) == self.topology.num_ranks

    @property
    def is_draining(self) -> bool:
        """A rank of it is draining: the instance is leaving (route nothing new to it), though still looked up."""
        return any(entry.draining for entry in self.entries.values())


def topology_of(put: RankPut) -> Topology:
    """The instance-wide fields a rank reports, in SGLang's ``PrefillServerInfo`` shape."""
    return Topology(
        attn_tp_size=put.attn_tp_size,
        attn_cp_size=put.attn_cp_size,
        dp_size=put.attn_dp_size if put.system_dp_size == 1 else put.system_dp_size,
        pp_size=put.pp_size,
        page_size=put.page_size,
        kv_cache_dtype=put.kv_cache_dtype,
        follow_bootstrap_room=put.load_balance_method == FOLLOW_BOOTSTRAP_ROOM,
        enable_dsa_cache_layer_split=put.enable_dsa_cache_layer_split,
        prefill_http_port=put.prefill_http_port,
    )


def key_of(put: RankPut) -> RankKey:
    dp_group = put.attn_dp_rank if put.system_dp_size == 1 else put.system_dp_rank
    return (dp_group, put.attn_cp_rank, put.attn_tp_rank, put.pp_rank)


def validate_put(put: RankPut) -> str:
    """Check a registration's values; returns its instance id. Raises 400 naming the bad field."""
    for size_name, rank_name in (
        ("attn_tp_size", "attn_tp_rank"),
        ("attn_cp_size", "attn_cp_rank"),
        ("attn_dp_size", "attn_dp_rank"),
        ("pp_size", "pp_rank"),
        ("system_dp_size", "system_dp_rank"),
    ):
        size, rank = getattr(put, size_name), getattr(put, rank_name)
        if not 1 <= size <= MAX_PARALLEL_SIZE:
            raise errors.bad_request("invalid_size", f"{size_name} must be in [1, {MAX_PARALLEL_SIZE}], got {size}")
        if not 0 <= rank < size:
            raise errors.bad_request("invalid_rank", f"{rank_name} must be in [0, {size_name}={size}), got {rank}")
    if put.attn_dp_size > 1 and put.system_dp_size > 1:
        raise errors.bad_request(
            "invalid_size", "attn_dp_size and system_dp_size cannot both be > 1 (DP attention is one or the other)"
        )
    num_ranks = topology_of(put).num_ranks
    if num_ranks > MAX_PARALLEL_SIZE:
        raise errors.bad_request("invalid_size", f"dp x cp x tp x pp = {num_ranks} ranks exceeds {MAX_PARALLEL_SIZE}")
    _check_host("rank_ip", put.rank_ip)
    _check_port("rank_port", put.rank_port)
    if not 1 <= put.page_size <= MAX_PAGE_SIZE:
        raise errors.bad_request("invalid_field", f"page_size must be in [1, {MAX_PAGE_SIZE}], got {put.page_size}")
    _check_text("kv_cache_dtype", put.kv_cache_dtype)
    _check_text("load_balance_method", put.load_balance_method)
    if put.prefill_http_port is not None:
        _check_port("prefill_http_port", put.prefill_http_port)
    instance_id = DEFAULT_INSTANCE_ID if put.instance_id is None else put.instance_id
    check_instance_id(instance_id)
    return instance_id


def check_instance_id(instance_id: str) -> None:
    if not _INSTANCE_ID_RE.fullmatch(instance_id):  # (not ``match``: its ``$`` also matches before a final "\n")
        raise errors.bad_request(
            "invalid_instance_id",
            "instance_id must be 1-128 characters of [A-Za-z0-9._:@/-], starting with a letter or digit",
        )


def _check_text(name: str, value: str) -> None:
    if not value or len(value) > _MAX_TEXT or not value.isprintable() or any(c.isspace() for c in value):
        raise errors.bad_request("invalid_field", f"{name} must be 1-{_MAX_TEXT} printable characters without "
                                                  "whitespace")


def _check_host(name: str, value: str) -> None:
    """An IP address, or a host name a peer can connect to (a label over 63 characters, an empty one or
    a control character would fail only there, in the decode's connect)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        pass
    else:  # (bare: a decode connects to it as written, and "[::1]" resolves to nothing)
        mapped = getattr(address, "ipv4_mapped", None)  # (``::ffff:0.0.0.0`` is 0.0.0.0 to a dual-stack socket)
        scope = getattr(address, "scope_id", None)
        if (address.is_unspecified or address.is_multicast
                or (mapped is not None and (mapped.is_unspecified or mapped.is_multicast))
                or (scope is not None and not _SCOPE_ID_RE.fullmatch(scope))):
            raise errors.bad_request("invalid_field",
                                     f"{name} must be an address a peer can connect to, got {value[:80]!r}")
        return
    labels = value.removesuffix(".").split(".")
    if len(value) > 253 or not all(_LABEL_RE.fullmatch(label) for label in labels):
        raise errors.bad_request("invalid_field", f"{name} must be an IP address or a host name, got {value[:80]!r}")
    if _NUMBER_RE.fullmatch(labels[-1]):
        # Not a name but a number the resolver reads its own way (``010.0.0.1`` is 8.0.0.1 to inet_aton, ``0``
        # is 0.0.0.0), which ``ip_address`` refused: no top-level domain is numeric
        raise errors.bad_request("invalid_field", f"{name} must be an IP address in standard notation or a host "
                                                  f"name, got {value[:80]!r}")


def _check_port(name: str, value: int) -> None:
    if not 1 <= value <= 65535:
        raise errors.bad_request("invalid_field", f"{name} must be in [1, 65535], got {value}")


CONFLICT_WINDOW_S = 5.0  # a holder that renewed within this (our prefills renew every 2.5 s at most) is live


def _is_holder(existing: RankEntry, put: RankPut, extra: dict[str, Any]) -> bool:
    """The PUT comes from the process that holds the entry: same address, and same ``registrant`` where the entry
    has one."""
    if existing.address != RankAddress(rank_ip=put.rank_ip, rank_port=put.rank_port):
        return False
    theirs = existing.extra.get("registrant")
    return not theirs or extra.get("registrant") == theirs


def _held_by_another(existing: RankEntry, put: RankPut, extra: dict[str, Any], now: float,
                     ttl_s: float) -> float | None:
    """Another process (its ``registrant`` mark differs) registers a rank at another address while the one
    holding it still renews: two prefills sharing an instance id would take turns owning the rank, and
    the decodes of the other's requests wait for KV that never comes. Returns the seconds until the holder
    stops counting as live (a restart's PUT succeeds then, unless the holder renewed meanwhile), or None: no
    conflict."""
    mine, theirs = extra.get("registrant"), existing.extra.get("registrant")
    if not mine or not theirs or mine == theirs:
        return None  # (an SGLang prefill sends none: its restarts replace at once, as in SGLang)
    if existing.address == RankAddress(rank_ip=put.rank_ip, rank_port=put.rank_port):
        return None  # (a restart on the same address: the old one is gone)
    if existing.draining and not put.draining:
        return None  # (the holder is leaving: its successor, e.g. a rolling restart's, takes the rank at once)
    window = min(CONFLICT_WINDOW_S, ttl_s) if ttl_s > 0 else CONFLICT_WINDOW_S
    left_s = window - (now - existing.last_seen)
    return left_s if left_s > 0 else None


def _tombstone_mark(extra: dict[str, Any] | None) -> str | None:
    """The ``registrant`` a goodbye's tombstone is kept under and a PUT is checked against: a non-empty string, else
    None (an unmarked PUT, SGLang's: nothing tells its process from the next one on the address)."""
    mine = (extra or {}).get("registrant")
    return mine if isinstance(mine, str) and mine else None


# A goodbye's tombstone outlives any renewal still on its way (the registrar gives up on a PUT after 5 s at most; a
# body that dribbles in is cut off after --body-timeout-s, 60 s by default) and, when longer, a lease
TOMBSTONE_MIN_S = 60.0
MAX_TOMBSTONES = 16_384  # (~300 bytes each, the registrant kept as a digest; beyond it the oldest goes first)


class Registry:
    """All prefill instances known to one registry process (see the module docstring)."""

    def __init__(self, *, ttl_s: float, max_ranks: int, tombstone_s: float | None = None,
                 body_timeout_s: float = 0.0) -> None:
        """``body_timeout_s``: how long the server lets a request body dribble in (``--body-timeout-s``): a renewal
        that slow still lands, so a goodbye's tombstone lasts at least that long (unless ``tombstone_s`` is given)."""
        self._ttl_s = ttl_s
        self._max_ranks = max_ranks
        self._instances: dict[str, Instance] = {}
        lifetime_s = max(ttl_s, TOMBSTONE_MIN_S, body_timeout_s) if tombstone_s is None else tombstone_s
        self.tombstones = Tombstones(lifetime_s=lifetime_s, max_count=MAX_TOMBSTONES)
        self.num_puts_after_goodbye = 0  # PUTs refused 410: sent by a process that had deregistered the rank
        self.num_ranks = 0
        self.num_registrations = 0
        self.num_replacements = 0
        self.num_expirations = 0
        self.num_deregistrations = 0
        self.num_drains = 0  # ranks that turned draining

    @property
    def instances(self) -> dict[str, Instance]:
        return self._instances

    def register(self, put: RankPut, extra: dict[str, Any], now: float) -> tuple[Instance, bool]:
        """Store or refresh one rank; returns (its instance, whether the rank key is new)."""
        instance_id = validate_put(put)
        topology = topology_of(put)
        key = key_of(put)
        if self.tombstones:  # (nothing to look up unless a marked goodbye came in the last ``tombstone_s``)
            self._check_tombstone(instance_id, key, extra, now)
        instance = self._instances.get(instance_id)
        if instance is not None:
            self._expire(instance, now)
            instance = self._instances.get(instance_id)
        superseded: list[RankKey] = []
        if instance is not None and instance.topology != topology:
            others = [k for k in instance.entries if k != key]
            if others and self._ttl_s <= 0 and all(
                now - instance.entries[k].last_seen >= CONFLICT_WINDOW_S for k in others
            ):
                # No leases: ranks that register once (SGLang's) never expire nor deregister, so a layout
                # none of them has re-sent for a while is a previous run's, superseded by this restart
                superseded, others = others, []
            if others:
                raise errors.conflict(
                    "topology_conflict",
                    f"instance {instance_id!r} has {len(others)} live rank(s) with a different topology: "
                    f"{_diff(instance.topology, topology)}; it is accepted once they expire or deregister",
                )
        existing = instance.entries.get(key) if instance is not None else None
        held_for_s = _held_by_another(existing, put, extra, now, self._ttl_s) if existing is not None else None
        if existing is not None and put.draining and not _is_holder(existing, put, extra):
            # A draining process's renewal after its successor took the rank (or one sharing its instance id):
            # it must not take the rank back, or decodes would look the successor's rooms up at a leaving prefill
            raise errors.conflict(
                "instance_conflict",
                f"rank {existing.key!r} of instance {instance_id!r} is now held by another process at "
                f"{existing.address.rank_ip}:{existing.address.rank_port}: a draining rank does not take it back")
        if held_for_s is not None:
            assert existing is not None
            # ``retry_after_s``: a restarted prefill's registrar retries right when the old lease stops counting
            # (a live holder renews meanwhile, and the next try is refused again)
            raise errors.conflict(
                "instance_conflict",
                f"rank {existing.key!r} of instance {instance_id!r} is held by another live process at "
                f"{existing.address.rank_ip}:{existing.address.rank_port} (renewed {now - existing.last_seen:.1f}s "
                "ago): give each prefill its own --instance-id; a restarted one takes over once the old lease "
                f"lapses (at most {CONFLICT_WINDOW_S:g}s after its last renewal; in {held_for_s:.2f}s unless "
                "it renews)", retry_after_s=held_for_s)
        if existing is None and self.num_ranks - len(superseded) >= self._max_ranks:  # (those dropped free room)
            raise errors.unavailable("registry_full", f"registry holds the maximum of {self._max_ranks} ranks")
        for old_key in superseded:
            old = instance.entries.pop(old_key)  # type: ignore[union-attr]
            self.num_ranks -= 1
            logger.warning("rank dp=%s cp=%s tp=%s pp=%s of %r at %s:%s dropped: a new layout registered",
                           *old_key, instance_id, old.address.rank_ip, old.address.rank_port)
        if instance is None:
            instance = Instance(instance_id=instance_id, topology=topology)
            self._instances[instance_id] = instance
        else:
            instance.topology = topology
        expires_at = now + self._ttl_s if self._ttl_s > 0 else math.inf
        address = RankAddress(rank_ip=put.rank_ip, rank_port=put.rank_port)
        self.num_registrations += 1
        if existing is None:
            instance.entries[key] = RankEntry(
                key=key,
                address=address,
                extra=extra,
                first_seen=now,
                last_seen=now,
                expires_at=expires_at,
                registered_unix=time.time(),
                draining=put.draining,
            )
            self.num_ranks += 1
            if put.draining:  # (a registry restarted during the drain)
                self.num_drains += 1
                logger.info("rank dp=%s cp=%s tp=%s pp=%s of %r at %s:%s registered draining", *key, instance_id,
                            put.rank_ip, put.rank_port)
        else:
            # (sticky for the process that said it: a renewal sent before the drain began and arriving after it
            # must not undo it; a successor's registration clears it. Only a ``registrant`` mark tells that process
            # from the next one on the same address: unmarked, a plain PUT clears it, or a prefill restarted on its
            # fixed port after a drain that lost its goodbye would be listed as leaving for as long as it lives)
            draining = put.draining or (existing.draining and _is_holder(existing, put, extra)
                                        and bool(existing.extra.get("registrant")))
            if draining and not existing.draining:
                self.num_drains += 1
                logger.info("rank dp=%s cp=%s tp=%s pp=%s of %r at %s:%s draining: still looked up for the rooms it "
                            "holds, until it deregisters", *key, instance_id, put.rank_ip, put.rank_port)
            existing.draining = draining
            if existing.address != address:
                self.num_replacements += 1
                existing.first_seen = now
                existing.registered_unix = time.time()
                existing.num_puts = 0
            existing.address = address
            existing.extra = extra
            existing.last_seen = now
            existing.expires_at = expires_at
            existing.num_puts += 1
        instance.next_expiry = min(instance.next_expiry, expires_at)
        return instance, existing is None

    def deregister(self, put: RankPut, now: float, extra: dict[str, Any] | None = None) -> bool:
        """Drop a rank if it is still registered at the same address, and by the same process when the goodbye
        names its ``registrant`` (a restart on the same address is another process: its entry stays); returns
        whether it was dropped."""
        instance_id = validate_put(put)
        marked = _tombstone_mark(extra)
        if marked is not None:
            # (also when nothing is removed: the entry may have lapsed, or the registry restarted, and the PUT still
            # on its way would register it anew)
            self.tombstones.bury((instance_id, key_of(put), marked), now)
        instance = self._instances.get(instance_id)
        if instance is None:
            return False
        entry = instance.entries.get(key_of(put))
        if entry is None or entry.address != RankAddress(rank_ip=put.rank_ip, rank_port=put.rank_port):
            return False
        mine = (extra or {}).get("registrant")
        if mine and entry.extra.get("registrant") != mine:
            return False  # (the entry is another process's, or an unmarked one's: SGLang's, which never says goodbye)
        del instance.entries[entry.key]
        self.num_ranks -= 1
        self.num_deregistrations += 1
        if not instance.entries:
            del self._instances[instance_id]
        return True

    def find_instance(self, instance_id: str | None, now: float) -> Instance:
        """The instance a query names; absent: the only one. 503 if none, 400 if ambiguous."""
        if instance_id is not None:
            check_instance_id(instance_id)
            instance = self._instances.get(instance_id)
            if instance is not None:
                self._expire(instance, now)
                instance = self._instances.get(instance_id)
            if instance is None:
                raise errors.unavailable(
                    "not_registered", f"prefill instance {instance_id!r} has no registered ranks (yet)"
                )
            return instance
        if len(self._instances) > 1:
            for instance in list(self._instances.values()):
                self._expire(instance, now)
        if not self._instances:
            raise errors.unavailable("not_registered", "no prefill rank has registered yet")
        if len(self._instances) > 1:
            names = ", ".join(sorted(self._instances))
            raise errors.bad_request(
                "instance_id_required",
                f"this registry holds {len(self._instances)} prefill instances ({names}); "
                "pass the instance_id query parameter",
            )
        instance = next(iter(self._instances.values()))
        self._expire(instance, now)
        if instance.instance_id not in self._instances:
            raise errors.unavailable("not_registered", "no prefill rank has a live registration")
        return instance

    def topology(self, instance: Instance) -> Topology:
        """The ready instance's topology; 503 while ranks are missing."""
        self._check_ready(instance)
        return instance.topology

    def lookup(self, instance: Instance, key: RankKey) -> RankAddress:
        """One rank's address; 503 while the instance is not ready, 404 for a rank it does not have."""
        self._check_ready(instance)
        entry = instance.entries.get(key)
        if entry is None:
            dp, cp, tp, pp = key
            t = instance.topology
            raise errors.not_found(
                "unknown_rank",
                f"no rank prefill_dp_rank={dp} prefill_cp_rank={cp} target_tp_rank={tp} target_pp_rank={pp} "
                f"in instance {instance.instance_id!r} (dp_size={t.dp_size} attn_cp_size={t.attn_cp_size} "
                f"attn_tp_size={t.attn_tp_size} pp_size={t.pp_size})",
            )
        return entry.address

    def sweep(self, now: float) -> int:
        """Drop every expired lease (and goodbye tombstone) now; returns how many leases were dropped."""
        before = self.num_expirations
        for instance in list(self._instances.values()):
            self._expire(instance, now)
        self.tombstones.sweep(now)
        return self.num_expirations - before

    def _check_tombstone(self, instance_id: str, key: RankKey, extra: dict[str, Any], now: float) -> None:
        """410 for a PUT of a rank its registrant has said goodbye to (see the module docstring)."""
        mine = _tombstone_mark(extra)
        if mine is None:
            return
        if not self.tombstones.is_buried((instance_id, key, mine), now):
            return
        self.num_puts_after_goodbye += 1
        logger.info("refused a PUT of rank dp=%s cp=%s tp=%s pp=%s of %r from registrant %s: it has deregistered the "
                    "rank (a renewal that arrived after its goodbye)", *key, instance_id, mine[:64])
        raise errors.gone("deregistered", f"rank {key!r} of instance {instance_id!r} was deregistered by this "
                                          "registrant (DELETE /route): its later registrations are refused; a new "
                                          "process registers with its own registrant")

    def _check_ready(self, instance: Instance) -> None:
        if not instance.is_ready:
            raise errors.unavailable(
                "not_ready",
                f"prefill instance {instance.instance_id!r} not fully registered yet "
                f"({len(instance.entries)}/{instance.topology.num_ranks} ranks registered)",
            )

    def _expire(self, instance: Instance, now: float) -> None:
        if now < instance.next_expiry:
            return
        expired = [key for key, entry in instance.entries.items() if entry.expires_at <= now]
        for key in expired:
            entry = instance.entries.pop(key)
            logger.warning(
                "rank dp=%s cp=%s tp=%s pp=%s of %r at %s:%s expired (no heartbeat for %.1fs)",
                *key,
                instance.instance_id,
                entry.address.rank_ip,
                entry.address.rank_port,
                now - entry.last_seen,
            )
        self.num_ranks -= len(expired)
        self.num_expirations += len(expired)
        if not instance.entries:
            del self._instances[instance.instance_id]
            return
        instance.next_expiry = min(entry.expires_at for entry in instance.entries.values())


def _diff(old: Topology, new: Topology) -> str:
    parts = [
        f"{name}={getattr(old, name)!r} vs {getattr(new, name)!r}"
        for name in old.__struct_fields__
        if getattr(old, name) != getattr(new, name)
    ]
    return ", ".join(parts)
