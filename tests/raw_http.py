"""Plain-socket HTTP/1.1 for tests that count a server's connections (caps, floods): every request on a socket
the test owns, nothing pooled or retried behind its back (tests only)."""

from __future__ import annotations

import os
import re
import select
import socket
import time

HANG_GUARD_S = 30.0  # a generous bound on any one read: only a hang reaches it


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=HANG_GUARD_S)


def read_reply(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response: status, headers (lower-case names), body (by Content-Length, else to the close)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines[1:])}
    if "content-length" in headers:
        while len(body) < int(headers["content-length"]):
            chunk = sock.recv(65536)
            assert chunk, "closed inside a response body"
            body += chunk
    else:
        while chunk := sock.recv(65536):
            body += chunk
    return int(lines[0].split()[1]), headers, body


def request(sock: socket.socket, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    head = f"{method} {path} HTTP/1.1\r\nhost: server\r\ncontent-length: {len(body)}\r\n"
    if body:
        head += "content-type: application/json\r\n"
    sock.sendall(head.encode() + b"\r\n" + body)
    return read_reply(sock)


def once(port: int, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    with connect(port) as sock:
        return request(sock, method, path, body)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes it (EOF or reset)."""
    out = b""
    while True:
        try:
            data = sock.recv(65536)
        except ConnectionResetError:
            return out
        if not data:
            return out
        out += data


def is_closed(sock: socket.socket, timeout_s: float) -> bool:
    """The server closed ``sock`` (EOF or reset, after an answer or not) within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return False
        try:
            if sock.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True


def open_sockets(pid: int) -> int:
    """Sockets process ``pid`` holds open (from ``/proc``)."""
    fd_dir = f"/proc/{pid}/fd"
    count = 0
    for fd in os.listdir(fd_dir):
        try:
            count += os.readlink(f"{fd_dir}/{fd}").startswith("socket:")
        except FileNotFoundError:  # (closed meanwhile)
            pass
    return count


def metric(text: str, name: str, **labels: str) -> float:
    """The value of Prometheus series ``name`` with ``labels`` (a subset) in ``text``."""
    for line in text.splitlines():
        match = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if match and all(f'{k}="{v}"' in (match.group(1) or "") for k, v in labels.items()):
            return float(match.group(2))
    raise AssertionError(f"no {name} {labels} in the metrics")


def metrics(port: int) -> str:
    status, _, body = once(port, "GET", "/metrics")
    assert status == 200, body
    return body.decode()


def flood_past_cap(port: int, pid: int, cap: int, probation_slots: int, prefix: str,
                   ) -> tuple[list[socket.socket], list[socket.socket]]:
    """Hold ``cap`` silent connections to ``port`` (server process ``pid``), then open five times as many: checks that
    the server's ``{prefix}`` metrics count them, that it holds at most ``cap + probation_slots`` of them, that it
    closed the excess and kept the held ones. Returns (held, flood), still open: the caller closes them (they are
    closed here if a check fails)."""
    baseline = open_sockets(pid)
    held = [connect(port) for _ in range(cap)]  # silent: they hold every admitted slot
    flood = [connect(port) for _ in range(5 * cap)]
    try:
        # A probe made after them (accepted after them: the kernel's queue is in order) is served all the same
        text = metrics(port)
        assert metric(text, prefix, slot="admitted") == cap
        assert metric(text, prefix, slot="probation") <= probation_slots
        assert metric(text, f"{prefix}_limit") == cap
        held_now = open_sockets(pid) - baseline
        assert held_now <= cap + probation_slots, (held_now, baseline)  # (without the cap: 48 and more)
        # The excess of the flood was closed (those left are on probation, their head still due)
        closed = sum(is_closed(sock, HANG_GUARD_S if i < len(flood) - probation_slots else 0.0)
                     for i, sock in enumerate(flood))
        assert closed >= len(flood) - probation_slots, closed
        assert all(not is_closed(sock, 0.0) for sock in held)  # (admitted: served as ever, within their timeouts)
    except BaseException:
        for sock in held + flood:
            sock.close()
        raise
    return held, flood
