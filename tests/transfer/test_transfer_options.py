"""``--transfer-option``: every backend validates its options (unknown key, bad value -> an error naming
the backend and the option) and the values reach the library (sockets, the UCX context)."""

from __future__ import annotations

import ctypes
import socket
import time
from pathlib import Path

import pytest

from transfer import WriteState, create_backend
from transfer.netaddr import interface_of, is_local_address, join_host_port, route_source, split_host_port
from transfer.options import TransferOptionError, split_pairs
from transfer.registry import build_backend, check_options


@pytest.mark.parametrize("name", ["tcp", "mooncake", "nixl"])
def test_unknown_option_names_backend_and_option(name: str) -> None:
    with pytest.raises(TransferOptionError) as info:
        check_options(name, {"no_such_knob": "1"})
    assert repr(name) in str(info.value) and "no_such_knob" in str(info.value)
    assert "known options" in str(info.value)


@pytest.mark.parametrize(("name", "key", "value"), [
    ("tcp", "sndbuf_bytes", "-4"),
    ("tcp", "connect_timeout_s", "soon"),
    ("mooncake", "protocol", "udp"),
    ("mooncake", "metadata_server", "zookeeper://x"),
    ("mooncake", "device_name", "mlx5_0,,mlx5_1"),
    ("nixl", "ucx_tls", "tcp,carrier_pigeon"),
    ("nixl", "ucx_error_handling_mode", "sometimes"),
    ("nixl", "ucx_num_workers", "0"),
])
def test_bad_value_names_backend_option_and_value(name: str, key: str, value: str) -> None:
    with pytest.raises(TransferOptionError) as info:
        check_options(name, {key: value})
    assert f"{key}={value!r}" in str(info.value) and repr(name) in str(info.value)


def test_good_values_pass() -> None:
    check_options("tcp", {"sndbuf_bytes": "1048576", "rcvbuf_bytes": "1048576", "connect_timeout_s": "2.5"})
    check_options("mooncake", {"protocol": "rdma", "device_name": "mlx5_0,mlx5_1",
                               "metadata_server": "etcd://10.0.0.1:2379", "max_batch_blocks": "512"})
    check_options("nixl", {"backends": "UCX", "ucx_tls": "tcp,^cma", "ucx_net_devices": "eth0,mlx5_0:1",
                           "ucx_error_handling_mode": "none", "ucx_num_workers": "2", "num_threads": "0"})


def test_a_backend_without_options_takes_none() -> None:
    check_options("fake", {})
    with pytest.raises(TransferOptionError, match="'fake' takes no options"):
        check_options("fake", {"x": "1"})


def test_split_pairs() -> None:
    assert split_pairs(["a=1", "b=x=y", "c="]) == {"a": "1", "b": "x=y", "c": ""}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        split_pairs(["novalue"])
    with pytest.raises(ValueError, match="given twice"):
        split_pairs(["a=1", "a=2"])


def test_tcp_socket_buffers_and_advertised_address() -> None:
    backend = build_backend("tcp", host="0.0.0.0", advertise_host="127.0.0.1",
                            options={"sndbuf_bytes": "262144", "rcvbuf_bytes": "262144"})
    peer = create_backend("tcp")
    try:
        host, port = split_host_port(backend.endpoint().decode())
        assert host == "127.0.0.1" and port > 0
        src = (ctypes.c_ubyte * 64)(*range(64))
        dst = (ctypes.c_ubyte * 64)()
        peer.register([(ctypes.addressof(dst), 64)])
        backend.register([(ctypes.addressof(src), 64)])
        peer_id = backend.connect(peer.endpoint())
        handle = backend.write(peer_id, [(ctypes.addressof(src), ctypes.addressof(dst), 64)])
        deadline = time.monotonic() + 10
        while backend.poll(handle) == WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.005)
        assert backend.poll(handle) == WriteState.DONE and bytes(dst) == bytes(range(64))
        sock = backend._peers[peer_id].sock  # type: ignore[attr-defined]
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) >= 262144  # the kernel doubles it
    finally:
        backend.close()
        peer.close()


def test_tcp_bound_to_every_interface_needs_an_advertised_address() -> None:
    with pytest.raises(ValueError, match="advertise_host"):
        create_backend("tcp", host="0.0.0.0")


def test_nixl_ucx_settings_reach_ucx(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl_cu12")
    # UCX refuses a shared-memory-only transport list under the default peer error mode: if ucx_tls did
    # not reach UCX, the agent would be created with the default transports and this would pass.
    monkeypatch.delenv("UCX_TLS", raising=False)
    with pytest.raises(Exception, match=r"(?i)backend"):
        build_backend("nixl", host="127.0.0.1", advertise_host="127.0.0.1", options={"ucx_tls": "posix"})
    ok = build_backend("nixl", host="127.0.0.1", advertise_host="127.0.0.1",
                       options={"ucx_tls": "posix", "ucx_error_handling_mode": "none"})
    ok.close()
    with pytest.raises(TransferOptionError, match="no NIXL plugin 'NOPE'"):
        build_backend("nixl", host="127.0.0.1", advertise_host="127.0.0.1", options={"backends": "NOPE"})


def test_netaddr_helpers() -> None:
    assert is_local_address("127.0.0.1") and not is_local_address("192.0.2.77")
    assert interface_of("127.0.0.1") == "lo" and interface_of("192.0.2.77") is None
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert join_host_port("::1", 5) == "[::1]:5" and split_host_port("[::1]:5") == ("::1", 5)
    assert join_host_port("10.0.0.1", 5) == "10.0.0.1:5" and split_host_port("10.0.0.1:5") == ("10.0.0.1", 5)


def test_mooncake_rdma_needs_the_devices_it_names(tmp_path: Path) -> None:
    from transfer.mooncake import _check_rdma_devices

    with pytest.raises(TransferOptionError, match="protocol=rdma: this machine has no RDMA device"):
        _check_rdma_devices("", root=str(tmp_path / "none"))
    (tmp_path / "mlx5_0").mkdir()
    (tmp_path / "mlx5_1").mkdir()
    _check_rdma_devices("", root=str(tmp_path))
    _check_rdma_devices("mlx5_1", root=str(tmp_path))
    with pytest.raises(TransferOptionError, match="no RDMA device mlx5_7 here \\(have: mlx5_0, mlx5_1\\)"):
        _check_rdma_devices("mlx5_0,mlx5_7", root=str(tmp_path))


def test_nixl_default_devices_are_the_advertised_interface_and_every_rdma_port(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import transfer.nixl as nixl

    for device, ports in (("mlx5_0", ["1"]), ("mlx5_1", ["1", "2"])):
        for port in ports:
            (tmp_path / device / "ports" / port).mkdir(parents=True)
    assert nixl.rdma_ports(str(tmp_path)) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert nixl.rdma_ports(str(tmp_path / "none")) == []
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setattr(nixl, "rdma_ports", lambda: ["mlx5_0:1"])
    assert nixl._backend_params({}, 0, "127.0.0.1")["ucx_devices"] == "lo,mlx5_0:1"
    assert "ucx_devices" not in nixl._backend_params({}, 0, "192.0.2.7")  # not ours: UCX decides
    assert nixl._backend_params({"ucx_net_devices": "eth9"}, 0, "127.0.0.1")["ucx_devices"] == "eth9"
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    assert "ucx_devices" not in nixl._backend_params({}, 0, "127.0.0.1")  # the environment decides
