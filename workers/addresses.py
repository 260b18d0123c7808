"""The worker's two addresses: ``--host`` (what its sockets bind) and ``--advertise-host`` (what it tells
others: the registry entry, the KV control plane, every backend's data endpoint, its instance id).

``advertised_host(host, advertise_host, registry_url)`` runs once at start-up, before the engine loads,
and either answers the address to advertise or raises ``AddressError`` with a message that says what to
change:
* ``--host`` must be an address of this machine (or ``0.0.0.0`` / ``::`` for every interface);
* with a specific ``--host``, the advertised address is that address; another ``--advertise-host`` is a
  mismatch (peers would connect where nothing listens);
* with a wildcard ``--host``, ``--advertise-host`` (a name is resolved once) must be an address of this
  machine; by default it is the source address of the route to the registry (or, with no registry, of
  the default route; 127.0.0.1 where loopback is the only interface);
* a loopback address is refused as soon as the registry is on another host (nobody there could reach it).
"""

from __future__ import annotations

import socket
from urllib.parse import urlsplit

from transfer.netaddr import is_local_address, is_loopback, is_wildcard, route_source

_DEFAULT_ROUTE_PROBE = "192.0.2.1"  # TEST-NET-1: only its route is looked up, nothing is sent


class AddressError(ValueError):
    """A ``--host``/``--advertise-host`` combination that cannot work; the message says why."""


def _literal(name: str, flag: str) -> str:
    name = name.strip("[]")
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise AddressError(f"{flag} {name!r} does not resolve: {exc}") from None
    return str(infos[0][4][0])


def _only_loopback() -> bool:
    try:
        return [name for _, name in socket.if_nameindex()] == ["lo"]
    except OSError:
        return False


def advertised_host(host: str, advertise_host: str | None, registry_url: str | None) -> str:
    registry_host = urlsplit(registry_url).hostname if registry_url else None
    if not is_wildcard(host) and not is_local_address(_literal(host, "--host")):
        raise AddressError(f"--host {host}: not an address of this machine (give one of its addresses, or "
                           "0.0.0.0 for every interface)")
    if advertise_host:
        advertised = _literal(advertise_host, "--advertise-host")
        if not is_wildcard(host) and advertised != _literal(host, "--host"):
            raise AddressError(
                f"--advertise-host {advertise_host} does not match --host {host}: peers would connect to "
                f"{advertised}, where this worker does not listen (bind --host 0.0.0.0, or drop --advertise-host)")
        if is_wildcard(advertised):
            raise AddressError("--advertise-host must be an address peers can connect to, not a wildcard")
        if not is_local_address(advertised):
            raise AddressError(f"--advertise-host {advertise_host}: not an address of this machine")
    elif not is_wildcard(host):
        advertised = _literal(host, "--host")
    else:
        target = registry_host or _DEFAULT_ROUTE_PROBE
        try:
            advertised = route_source(target.strip("[]"))
        except OSError as exc:
            if registry_host is None and _only_loopback():
                return "127.0.0.1"  # nothing but loopback here: nobody elsewhere could reach us anyway
            where = f"the registry {registry_host}" if registry_host else "a default route"
            raise AddressError(f"--host {host}: cannot pick an address to advertise: no route to {where} "
                               f"({exc}); give --advertise-host") from None
    if is_loopback(advertised) and registry_host and not is_loopback(_literal(registry_host, "--bootstrap")):
        raise AddressError(
            f"this worker would advertise the loopback address {advertised}, but the registry {registry_host} "
            "is on another host: workers there cannot reach it (give --host or --advertise-host an address "
            "of an interface they can reach)")
    return advertised
