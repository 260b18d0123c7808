"""Two "hosts" on one machine: Linux network + mount namespaces joined by a veth pair (tests only).

Lifecycle:
1. ``TwoHosts.create(tmp)`` (root, util-linux ``unshare``/``nsenter``, iproute2 ``ip``) starts one holder
   process per side with ``unshare --net --mount``: the side gets its own network stack (only ``lo`` up),
   its own private ``/dev/shm`` (a tmpfs) and a sysfs mounted for its own namespace (so
   ``/sys/class/net/<if>/statistics`` shows its interfaces). A veth pair is made and one end moved into
   each side, with ``a.addr``/``b.addr`` on a /24 (and ``addr6`` on a /64 where IPv6 is on).
   ``Unavailable`` says why when any step is impossible (the test then skips with that reason).
2. ``side.start(name, *args)`` runs ``python *args`` inside the side (``nsenter`` into both namespaces;
   the Python process itself, not a wrapper, so it is killed by pid); ``side.python(code)`` runs a snippet
   there and answers its stdout; ``side.counters(ifname)`` reads the interface's rx/tx byte counters.
3. ``close()`` (also on failure) kills every process started in the sides, then the holders: the
   namespaces, their tmpfs and the veth pair die with their last process. A veth end still outside
   (set-up failed half-way) is deleted.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from pdtest import stop_processes

ROOT = Path(__file__).resolve().parents[2]
_HOLDER = ("mount -t tmpfs -o size=256m pd-shm /dev/shm && mount -t sysfs sysfs /sys && ip link set lo up "
           "&& echo ready && exec sleep 100000")


class Unavailable(RuntimeError):
    """Namespaces or veth pairs cannot be made here (not root, tools missing, kernel refuses)."""


def _run(*argv: str) -> str:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        raise Unavailable(f"{' '.join(argv)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


@dataclass
class Side:
    name: str
    addr: str
    ifname: str
    tmp: Path
    addr6: str | None = None  # its IPv6 address on the veth (None where IPv6 is off)
    holder: subprocess.Popen[bytes] | None = None
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def _enter(self) -> list[str]:
        assert self.holder is not None
        return ["nsenter", "-t", str(self.holder.pid), "--net", "--mount", "--"]

    def start(self, name: str, *args: str, env: dict[str, str | None] | None = None) -> subprocess.Popen[bytes]:
        """``python *args`` in this side; ``env`` adds variables (None: removes one)."""
        log = open(self.tmp / f"{self.name}-{name}.log", "wb")  # noqa: SIM115 - closed with the process
        merged = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env = {k: v for k, v in merged.items() if v is not None}
        proc = subprocess.Popen([*self._enter(), sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
                                env=full_env, cwd=ROOT, start_new_session=True)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.tmp / f"{self.name}-{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def python(self, code: str, timeout_s: float = 120.0, env: dict[str, str] | None = None) -> str:
        out = subprocess.run([*self._enter(), sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=timeout_s, cwd=ROOT, env={**os.environ, **(env or {})})
        if out.returncode != 0:
            raise RuntimeError(f"snippet in {self.name} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
        return out.stdout

    def wait_http_ok(self, url: str, timeout_s: float = 120.0) -> None:
        self.python(
            "import time, urllib.request\n"
            f"deadline = time.monotonic() + {timeout_s}\n"
            "while True:\n"
            "    try:\n"
            f"        if urllib.request.urlopen({url!r}, timeout=2).status == 200: break\n"
            "    except Exception as exc:\n"
            "        if time.monotonic() > deadline: raise SystemExit(f'not ready: {exc}')\n"
            "    time.sleep(0.1)\n",
            timeout_s + 10,
        )

    def counters(self, ifname: str) -> dict[str, int]:
        """rx/tx bytes of an interface of this side, from its own sysfs."""
        stats = f"/sys/class/net/{ifname}/statistics"
        out = _run(*self._enter(), "cat", f"{stats}/rx_bytes", f"{stats}/tx_bytes")
        rx, tx = (int(v) for v in out.split())
        return {"rx": rx, "tx": tx}

    def stop(self) -> None:
        stop_processes(self.procs)
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait()


@dataclass
class TwoHosts:
    a: Side
    b: Side

    @classmethod
    def create(cls, tmp: Path, subnet: str = "10.213.0") -> TwoHosts:
        if os.geteuid() != 0:
            raise Unavailable("needs root (network namespaces and veth pairs)")
        for tool in ("unshare", "nsenter", "ip", "mount"):
            if shutil.which(tool) is None:
                raise Unavailable(f"{tool} is not installed")
        tag = f"{os.getpid() % 100000}"
        hosts = cls(Side("a", f"{subnet}.1", f"pdv{tag}a", tmp, "fd00:213::1"),
                    Side("b", f"{subnet}.2", f"pdv{tag}b", tmp, "fd00:213::2"))
        try:
            for side in (hosts.a, hosts.b):
                side.holder = subprocess.Popen(
                    ["unshare", "--net", "--mount", "--propagation", "private", "--", "sh", "-c", _HOLDER],
                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                assert side.holder.stdout is not None
                if side.holder.stdout.readline().strip() != b"ready":
                    side.holder.wait(10)
                    err = side.holder.stderr.read().decode(errors="replace") if side.holder.stderr else ""
                    raise Unavailable(f"cannot make a namespace with a private /dev/shm: {err.strip()}")
            _run("ip", "link", "add", hosts.a.ifname, "type", "veth", "peer", "name", hosts.b.ifname)
            try:
                for side in (hosts.a, hosts.b):
                    assert side.holder is not None
                    _run("ip", "link", "set", side.ifname, "netns", str(side.holder.pid))
            finally:
                for side in (hosts.a, hosts.b):  # whichever end is still here (a half-done set-up)
                    subprocess.run(["ip", "link", "del", side.ifname], capture_output=True, timeout=30)
            for side in (hosts.a, hosts.b):
                _run(*side._enter(), "ip", "addr", "add", f"{side.addr}/24", "dev", side.ifname)
                _run(*side._enter(), "ip", "link", "set", side.ifname, "up")
                if side.addr6 is not None:
                    v6 = subprocess.run([*side._enter(), "ip", "-6", "addr", "add", f"{side.addr6}/64", "dev",
                                         side.ifname, "nodad"], capture_output=True, timeout=30)
                    if v6.returncode != 0:
                        side.addr6 = None
        except BaseException:
            hosts.close()
            raise
        return hosts

    def close(self) -> None:
        for side in (self.a, self.b):
            side.stop()


def two_hosts_or_skip(tmp: Path, subnet: str = "10.213.0") -> Iterator[TwoHosts]:
    """A pytest fixture's body: ``TwoHosts.create`` (the test skipped, with the reason, where namespaces and veth
    pairs cannot be made), closed after the test."""
    try:
        made = TwoHosts.create(tmp, subnet=subnet)
    except Unavailable as exc:
        pytest.skip(f"two network namespaces joined by a veth pair cannot be made here: {exc}")
    try:
        yield made
    finally:
        made.close()
