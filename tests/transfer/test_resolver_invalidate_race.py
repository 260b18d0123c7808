"""The decode's registry cache and an ``invalidate`` racing a look-up in flight.

A look-up the registry answered with a prefill's old address (before the restarted prefill registered
again) that is stored after the decode invalidated that prefill leaves the dead address cached for
``cache_ttl_s``. The race is real (first assertion); what it costs is one refused connect per look-up:
a room sent there asks the registry once more (``DecodeSide._resolve_again``) and goes to the new
address, so no room fails for it.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from kvunit import make_args, wait_for

from bootstrap.client import BootstrapResolver
from transfer import KVManager, KVPoll, KVTimeouts
from transfer.fake import FakeBackend
from workers.worker import _RegistryResolver

QUICK = KVTimeouts(bootstrap_s=5.0, waiting_s=5.0, transfer_s=5.0, heartbeat_interval_s=0.1,
                   heartbeat_timeout_s=2.0)


class SlowRegistry:
    """A registry over real HTTP whose first rank look-up is answered with the address registered when it
    arrived, but only once ``gate`` opens (a registry answering slowly)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.registered = address
        self.gate = threading.Event()
        self.arrived = threading.Event()
        self.num_rank_gets = 0
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                query = {k: v[0] for k, v in parse_qs(urlsplit(self.path).query).items()}
                body: dict[str, object]
                if query["prefill_dp_rank"] == "-1":
                    body = {"attn_tp_size": 1, "attn_cp_size": 1, "dp_size": 1, "pp_size": 1, "page_size": None,
                            "kv_cache_dtype": None, "follow_bootstrap_room": True}
                else:
                    registry.num_rank_gets += 1
                    host, port = registry.registered
                    body = {"rank_ip": host, "rank_port": port}
                    if registry.num_rank_gets == 1:
                        registry.arrived.set()
                        registry.gate.wait(10)
                data = json.dumps(body).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.gate.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def test_an_invalidate_racing_a_lookup_costs_no_room() -> None:
    made: list[KVManager] = []
    old = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
    made.append(old)
    registry = SlowRegistry(old.control_address)
    client = BootstrapResolver(cache_ttl_s=30.0)
    try:
        lookup: list[tuple[str, int]] = []
        slow = threading.Thread(target=lambda: lookup.append(client.resolve("127.0.0.1", registry.port, "p")))
        slow.start()
        assert registry.arrived.wait(5)  # the look-up is in flight, answered with the old address
        old.close()  # the prefill dies and restarts on another control port, registered again
        new = KVManager("prefill", make_args(), FakeBackend(), timeouts=QUICK)
        made.append(new)
        registry.registered = new.control_address
        client.invalidate("127.0.0.1", registry.port, "p")  # the decode saw the old address fail
        registry.gate.set()
        slow.join(10)
        # the race: the old look-up's answer is stored after the invalidate, and cached
        assert lookup == [old.control_address]
        assert client.cached_address("127.0.0.1", registry.port, "p") == old.control_address

        decode = KVManager("decode", make_args(), FakeBackend(), timeouts=QUICK,
                           resolver=_RegistryResolver(client, 4, "auto"))
        made.append(decode)
        rooms = [decode.create_receiver(room, "127.0.0.1", registry.port, "p") for room in (1, 2, 3)]
        assert wait_for(lambda: all(r.poll() != KVPoll.Bootstrapping for r in rooms))
        assert [r.poll() for r in rooms] == [KVPoll.WaitingForInput] * 3, [r.failure() for r in rooms]
        assert client.cached_address("127.0.0.1", registry.port, "p") == new.control_address
    finally:
        client.close()
        registry.close()
        for m in made:
            m.close()
