"""Mooncake with a metadata server (``--transfer-option metadata_server=http://...``): every engine needs its own
segment name there. Named by the advertised host alone, a second worker on the same host failed to start
("Duplicate rpc_meta key"), and its failed start deleted the first one's entry, so a third started under the same
name as the first: a prefill then wrote one decode's KV into another's engine (or had it rejected).

Real engines and Mooncake's own HTTP metadata server, in a network namespace of the test's own with a veth address
(Mooncake refuses loopback in this mode; needs root and ``unshare``).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap

import pytest
from kvunit import run_mooncake_child

_CHILD = textwrap.dedent('''
    import ctypes, socket, subprocess, sys, time
    from transfer import WriteState
    from transfer.errors import TransferError
    from transfer.mooncake import MooncakeBackend

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", "import time; from mooncake.http_metadata_server import "
                               f"KVBootstrapServer as S; S({port}, '127.0.0.1').run(); time.sleep(300)"])
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), 0.2).close(); break
            except OSError:
                time.sleep(0.1)
        opts = {"metadata_server": f"http://127.0.0.1:{port}/metadata"}
        started = []
        for i in range(3):  # three workers on this host
            try:
                started.append(MooncakeBackend(host="10.9.0.1", options=opts))
            except TransferError as exc:
                print(f"worker {i} did not start: {exc}"); sys.exit(3)
        writer, d1, d2 = started
        assert d1.endpoint() != d2.endpoint()
        src, b1, b2 = ((ctypes.c_ubyte * 4096)() for _ in range(3))
        ctypes.memset(src, 0x5A, 4096)
        writer.register([(ctypes.addressof(src), 4096)])
        d1.register([(ctypes.addressof(b1), 4096)])
        d2.register([(ctypes.addressof(b2), 4096)])
        for target, buf, other in ((d1, b1, b2), (d2, b2, b1)):
            before = bytes(other)
            peer = writer.connect(target.endpoint())
            handle = writer.write(peer, [(ctypes.addressof(src), ctypes.addressof(buf), 4096)])
            deadline = time.monotonic() + 30
            while writer.poll(handle) == WriteState.PENDING and time.monotonic() < deadline:
                time.sleep(0.005)
            assert writer.poll(handle) == WriteState.DONE, writer.error(handle)
            assert bytes(buf) == bytes(src) and bytes(other) == before
        for backend in started:
            backend.close()
        print("ok")
    finally:
        server.kill()
''')


def test_mooncake_workers_sharing_a_host_and_a_metadata_server_each_get_their_own_segment() -> None:
    if shutil.which("unshare") is not None and subprocess.run(
            ["unshare", "--net", "--", "sh", "-c", "ip link add pdmc0 type veth peer name pdmc1"],
            capture_output=True).returncode != 0:
        pytest.skip("cannot make a network namespace with a veth here")
    run_mooncake_child(_CHILD, tools=("ip",), setup="ip link add pdmc0 type veth peer name pdmc1 && ip addr add "
                       "10.9.0.1/24 dev pdmc0 && ip link set pdmc0 up && ip link set pdmc1 up")
