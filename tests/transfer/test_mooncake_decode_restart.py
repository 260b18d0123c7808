"""Mooncake (P2P handshake, tcp) when a decode restarts under its predecessor's session name ("host:rpc_port": the
new process drew the same rpc port). The prefill's engine caches a session's segment descriptor (its tcp data port,
its buffers) for the life of the process, and keeps pooled data connections per host:data_port:

- the new decode on another data port: every connect (and so every registration, every room) to it failed for as
  long as the prefill ran, the engine dialling the old process's data port (connection refused; or, had another
  process taken that port, that process);
- the new decode on the same data port: the first connect failed (the pooled connection to the dead process) and
  the decode's registration with it was refused.

Real engines: the prefill in the test's child process, each decode a process of its own (killed to "restart"),
their ports forced into a small range (``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT``) so that a restart draws them again;
all in a network namespace of the test's own (needs root and ``unshare``).
"""

from __future__ import annotations

import textwrap

from kvunit import run_mooncake_child

_CHILD = textwrap.dedent('''
    import ctypes, os, subprocess, sys, time
    import msgspec
    from transfer import WriteState
    from transfer.errors import TransferError
    from transfer.mooncake import MooncakeBackend

    DECODE = """
    import ctypes, sys
    from transfer.mooncake import MooncakeBackend
    backend = MooncakeBackend(host="127.0.0.1")
    buf = (ctypes.c_ubyte * 4096)()
    backend.register([(ctypes.addressof(buf), 4096)])
    print(backend.endpoint().hex(), flush=True)
    for line in sys.stdin:
        print(bytes(buf).hex(), flush=True)
    """
    LOW = 15600  # (the range Mooncake draws a decode's rpc and data ports from: 3 ports)

    def listening(pid):
        out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if f"pid={pid}," in line}

    class Decode:
        def __init__(self, proc, endpoint):
            self.proc, self.endpoint = proc, endpoint
            session, _, regions, *_ = msgspec.msgpack.decode(endpoint)
            self.session, self.addr = session, regions[0][0]
            self.rpc_port = int(session.rsplit(":", 1)[1])
            (self.data_port,) = listening(proc.pid) - {self.rpc_port}

        def memory(self):
            self.proc.stdin.write("read\\n"); self.proc.stdin.flush()
            return bytes.fromhex(self.proc.stdout.readline().strip())

        def kill(self):
            self.proc.kill(); self.proc.wait()
            # (its rpc port's handshake connections wait in TIME-WAIT, where Mooncake would not draw that port for a
            # minute: end them, as that minute would)
            subprocess.run(["ss", "-K", "state", "time-wait", "sport", "=", f":{self.rpc_port}"], capture_output=True)

    def start_decode(want_rpc, want_data=None, avoid_data=None, within_s=60):
        """A decode on rpc port ``want_rpc`` (and data port ``want_data``, or any but ``avoid_data``): started
        again until Mooncake drew those (None if it did not within ``within_s``)."""
        env = {**os.environ, "MC_MIN_RPC_PORT": str(LOW), "MC_MAX_RPC_PORT": str(LOW + 2)}
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            proc = subprocess.Popen([sys.executable, "-c", DECODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.DEVNULL, text=True, env=env)
            line = proc.stdout.readline().strip()
            if not line:  # (no free port in the range just now)
                proc.wait(); time.sleep(0.2); continue
            decode = Decode(proc, bytes.fromhex(line))
            if (want_rpc is None or decode.rpc_port == want_rpc) and \\
                    (want_data is None or decode.data_port == want_data) and decode.data_port != avoid_data:
                return decode
            decode.kill()
        return None

    prefill = MooncakeBackend(host="127.0.0.1")
    src = (ctypes.c_ubyte * 4096)()
    prefill.register([(ctypes.addressof(src), 4096)])

    names = []  # the engine's name for the decode's session, per connect

    def send(decode, value):
        """Connect (as a decode's registration does) and write 4 KiB of ``value``: None, or why it failed."""
        ctypes.memset(src, value, 4096)
        try:
            peer = prefill.connect(decode.endpoint)
        except TransferError as exc:
            return f"connect: {exc}"
        names.append(prefill._names[decode.session][0])
        handle = prefill.write(peer, [(ctypes.addressof(src), decode.addr, 4096)])
        deadline = time.monotonic() + 30
        while prefill.poll(handle) == WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.005)
        state = prefill.poll(handle)
        prefill.disconnect(peer)  # (its control connection closed: the decode is going away)
        if state != WriteState.DONE:
            return f"write: {state} {prefill.error(handle)}"
        got = decode.memory()
        return None if got == bytes([value]) * 4096 else f"wrong bytes: {got[:8].hex()}"

    first = start_decode(None)
    assert send(first, 0x11) is None
    first.kill()

    # restarted on the same rpc port, another data port
    second = start_decode(first.rpc_port, avoid_data=first.data_port)
    if second is None:
        print("SKIP: could not draw the ports wanted"); sys.exit(0)
    assert second.session == first.session and second.data_port != first.data_port
    failures = [send(second, 0x20 + i) for i in range(3)]
    assert failures == [None, None, None], f"restart on another data port: {failures}"
    # a new name for the new process, then kept by its reconnections (no new descriptor fetch, no name growth)
    assert names[0] == first.session and len(set(names[1:])) == 1 and names[1] != names[0], names
    second.kill()

    # restarted on the same rpc port and the same data port (where the old process's data port is free again soon
    # enough: its closed connections may hold it for a minute)
    third = start_decode(second.rpc_port, want_data=second.data_port, within_s=15)
    if third is not None:
        failures = [send(third, 0x30 + i) for i in range(2)]
        assert failures == [None, None], f"restart on the same ports: {failures}"
        third.kill()
    prefill.close()
    print("ok")
''')


def test_mooncake_decode_restarted_under_the_same_session_gets_its_kv() -> None:
    run_mooncake_child(_CHILD, tools=("ss",), timeout_s=240)
