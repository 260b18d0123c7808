"""Small address helpers shared by the worker and the backends (IPv4 and IPv6, Linux).

Every lookup asks the kernel about the caller's network namespace (ioctl on a socket, ``/proc/self/net``),
never ``/sys/class/net``, which shows the namespace sysfs was mounted in.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import math
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

_SIOCGIFADDR = 0x8915
ACCEPT_RETRY_S = 0.1  # after a failed accept() (``accept_retrying``)...
ACCEPT_WARN_S = 10.0  # ...warned about at most this often (an fd leak would flood the log)
_accept_warned: dict[str, float] = {}  # listener name -> when its last failure was warned about


def is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]")


def listener(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket bound to ``host:port``, listening unless ``listen`` is False (then whoever serves it starts
    listening: until then a connection is refused); the IPv6 wildcard ``::`` takes IPv4 connections too (as
    it is documented: every interface; bound as asyncio and uvicorn bind it, it would be IPv6 only)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if host == "::" else 1)
        sock.bind((host, port))
        if listen:
            sock.listen()
    except BaseException:
        sock.close()
        raise
    return sock


def accept_retrying(sock: socket.socket, is_closing: Callable[[], bool], name: str,
                    ) -> tuple[socket.socket, Any] | None:
    """``sock.accept()`` for a listener's accept thread: None once ``is_closing()`` (the listener was shut down).
    Any other failure (EMFILE for a moment, or a network error Linux passes on from a pending connection) is
    retried after ``ACCEPT_RETRY_S``, warned about at most every ``ACCEPT_WARN_S``: ending the thread there left
    the worker deaf on that port, for good, while it looked healthy."""
    while True:
        try:
            return sock.accept()
        except OSError as exc:
            if is_closing():
                return None
            now = time.monotonic()
            if now - _accept_warned.get(name, -math.inf) >= ACCEPT_WARN_S:  # (also across accepts that succeed)
                _accept_warned[name] = now
                log.warning("%s: accept failed (%s); retrying", name, exc)
            time.sleep(ACCEPT_RETRY_S)


def dual_stack_sockets(host: str, port: int) -> list[socket.socket] | None:
    """For a uvicorn server on ``host:port``: the IPv6 wildcard's dual-stack ``listener``; None (uvicorn binds)
    for every other host."""
    return [listener(host, port)] if host.strip("[]") == "::" else None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def join_host_port(host: str, port: int) -> str:
    """``host:port`` with an IPv6 literal in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


def is_local_address(host: str) -> bool:
    """True when ``host`` is an address of an interface of this network namespace (it can be bound)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.bind((host.strip("[]"), 0))
        return True
    except OSError:
        return False


def interface_of(host: str) -> str | None:
    """The name of the interface holding address ``host`` (None if no interface of ours has it)."""
    try:
        wanted = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    if wanted.version == 6:
        try:
            with open("/proc/self/net/if_inet6") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 6 and ipaddress.ip_address(int(fields[0], 16)) == wanted:
                        return fields[5]
        except OSError:
            return None
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # no IPv4 address on it
            if socket.inet_ntoa(raw[20:24]) == str(wanted):
                return name
    return None


def route_source(host: str, port: int = 9) -> str:
    """The local address the kernel would use to reach ``host`` (a UDP connect: no packet is sent).
    ``OSError`` when there is no route."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    last: OSError | None = None
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.connect(sockaddr)
                return str(sock.getsockname()[0])
        except OSError as exc:
            last = exc
    raise last or OSError(f"no address for {host}")


_MAX_KEEPALIVE_S = 32767  # (Linux's MAX_TCP_KEEPIDLE and MAX_TCP_KEEPINTVL)
_MAX_USER_TIMEOUT_MS = 2**31 - 1


def watch_peer(sock: socket.socket, dead_after_s: float) -> None:
    """Have the kernel close ``sock`` (a TCP connection) once its peer has not answered for about ``dead_after_s``:
    keep-alive probes while the connection is idle (the first after a third of it, then every sixth, three
    unanswered ones end it) and ``TCP_USER_TIMEOUT`` while data of ours waits unacknowledged (a stream to a host
    that went away: retransmissions alone go on for ~15 minutes). A peer process that is merely slow or stopped
    still has its kernel answer; one that stops reading for that long while we send may be cut off too. Linux's
    options; where one is missing (another OS) the rest still apply."""
    # (clamped to what the kernel takes: keep-alive times up to 32767 s, the user timeout an int of ms; past them
    # setsockopt fails EINVAL and every connection with it: a longer timeout probes at the longest it can)
    idle = min(_MAX_KEEPALIVE_S, max(1, int(dead_after_s / 3)))
    interval = min(_MAX_KEEPALIVE_S, max(1, int(dead_after_s / 6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                        ("TCP_USER_TIMEOUT", min(_MAX_USER_TIMEOUT_MS, max(1000, int(dead_after_s * 1000))))):
        option = getattr(socket, name, None)
        if option is not None:
            sock.setsockopt(socket.IPPROTO_TCP, option, value)
