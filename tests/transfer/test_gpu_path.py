"""The GPU path is the CPU path: memory kinds decide how a backend registers and moves each region.

The CPU tests run everywhere (host memory is host memory; the grouping of a batch by memory type; the
worker's device setting). The ``gpu`` tests need a CUDA device (skipped cleanly without one): a pool built
with ``device="cuda"`` is device memory, tcp refuses it, NIXL moves VRAM pages and a host aux slot in one
batch, and a prefill/decode pair of ``pd-worker --device cuda`` serves a chat over NIXL.
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
import pytest

from transfer import WriteState, create_backend
from transfer.errors import TransferError
from transfer.memkind import device_of, device_regions, find_device
from transfer.nixl import xfer_groups
from workers.config import ConfigError, WorkerConfig
from workers.kv_pool import KVPool


def test_host_memory_is_host_memory() -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    raw = (ctypes.c_ubyte * 64)()
    assert device_of(int(buf.ctypes.data)) is None and device_of(ctypes.addressof(raw)) is None
    pool = KVPool(num_layers=2, num_pages=4, page_size=4, num_kv_heads=1, head_dim=4)
    assert device_regions(list(zip(pool.kv_ptrs(), pool.kv_data_lens(), strict=True))) == []


def test_a_batch_is_grouped_by_memory_type() -> None:
    blocks = [(100, 5000, 10), (200, 9000, 10), (150, 6000, 4)]  # (src, dst, len)
    assert xfer_groups(blocks, [], []) == [(("DRAM", 0, "DRAM", 0), blocks)]
    local = [(100, 64, 0)]  # src 100..164 on device 0
    remote = [(5000, 100, 1), (9000, 16, 1)]  # the peer's pages on its device 1
    assert xfer_groups(blocks, local, remote) == [
        (("VRAM", 0, "VRAM", 1), [(100, 5000, 10)]),
        (("DRAM", 0, "VRAM", 1), [(200, 9000, 10)]),
        (("VRAM", 0, "DRAM", 0), [(150, 6000, 4)]),
    ]
    assert find_device(remote, 9000, 16) == 1 and find_device(remote, 9000, 17) is None


def test_worker_device_setting() -> None:
    assert WorkerConfig(engine="torch", device="cuda").device == "cuda:0"
    assert WorkerConfig(engine="torch", device="cuda:1").device == "cuda:1"
    with pytest.raises(ConfigError, match="sim engine runs on the CPU"):
        WorkerConfig(engine="sim", device="cuda")
    with pytest.raises(ConfigError, match="cpu, cuda or cuda:N"):
        WorkerConfig(engine="torch", device="tpu")


# -- on a GPU --------------------------------------------------------------------------------------
def _gpu_pool() -> KVPool:
    return KVPool(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=8, dtype="bfloat16",
                  device="cuda:0")


@pytest.mark.gpu
def test_a_cuda_pool_is_device_memory_and_tcp_refuses_it() -> None:
    pool = _gpu_pool()
    regions = list(zip(pool.kv_ptrs(), pool.kv_data_lens(), strict=True))
    assert [d for _, _, d in device_regions(regions)] == [0] * len(regions)
    backend = create_backend("tcp")
    try:
        with pytest.raises(TransferError, match="host memory only"):
            backend.register(regions)
    finally:
        backend.close()


@pytest.mark.gpu
def test_nixl_writes_vram_pages_and_a_host_slot_in_one_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("nixl_cu12")
    import torch

    monkeypatch.delenv("UCX_TLS", raising=False)  # UCX picks its cuda transports
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    src, dst = _gpu_pool(), _gpu_pool()
    for buf in src.kv_buffers():
        buf.copy_(torch.randn(buf.shape, dtype=torch.float32).to(buf.dtype))
    src.aux[3, :16] = np.arange(16, dtype=np.uint8)
    sender, receiver = create_backend("nixl"), create_backend("nixl")
    try:
        sender.register([*zip(src.kv_ptrs(), src.kv_data_lens(), strict=True), (int(src.aux.ctypes.data),
                                                                                   src.aux.nbytes)])
        receiver.register([*zip(dst.kv_ptrs(), dst.kv_data_lens(), strict=True), (int(dst.aux.ctypes.data),
                                                                                     dst.aux.nbytes)])
        peer = sender.connect(receiver.endpoint())
        blocks = [(s + 2 * src.page_bytes, d + 5 * dst.page_bytes, 3 * src.page_bytes)
                  for s, d in zip(src.kv_ptrs(), dst.kv_ptrs(), strict=True)]
        aux_at = 3 * src.aux_slot_bytes
        blocks.append((int(src.aux.ctypes.data) + aux_at, int(dst.aux.ctypes.data) + aux_at, 16))
        handle = sender.write(peer, blocks)
        deadline = time.monotonic() + 30
        while sender.poll(handle) == WriteState.PENDING and time.monotonic() < deadline:
            time.sleep(0.001)
        assert sender.poll(handle) == WriteState.DONE, sender.error(handle)
        torch.cuda.synchronize()
        for s_buf, d_buf in zip(src.kv_buffers(), dst.kv_buffers(), strict=True):
            assert torch.equal(s_buf[2:5], d_buf[5:8])
        assert (dst.aux[3, :16] == np.arange(16, dtype=np.uint8)).all()
    finally:
        sender.close()
        receiver.close()


@pytest.mark.gpu
@pytest.mark.slow
def test_pd_workers_on_cuda_serve_a_chat_over_nixl(tmp_path: Path) -> None:
    pytest.importorskip("nixl_cu12")
    import openai
    from pdtest import Procs, start_bootstrap, start_gateway, start_worker, tiny_model_with_tokenizer

    model = tmp_path / "model"
    model.mkdir()
    tiny_model_with_tokenizer(model)
    procs = Procs(tmp_path)
    try:
        boot = start_bootstrap(procs)
        common = ("--engine", "torch", "--model", str(model), "--device", "cuda", "--transfer", "nixl",
                  "--transfer-option", "ucx_tls=tcp,cuda_copy,cuda_ipc", "--num-pages", "256")
        prefill = start_worker(procs, "prefill", *common, bootstrap=boot)
        decode = start_worker(procs, "decode", *common)
        port = start_gateway(procs, "--prefill", prefill.url, "--decode", decode.url)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="default", max_tokens=8, temperature=0,
                                             messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert out.usage is not None and out.usage.completion_tokens >= 1
    finally:
        procs.stop_all()


def test_a_prefill_with_its_kv_on_a_gpu_does_not_take_the_shared_memory_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """memmove cannot read device memory: a co-located decode's shared-memory offer is declined and the
    network backend carries the writes (device memory faked: the CPU cannot make any)."""
    import base64
    import sys

    import transfer.shm as shm
    from transfer import KVArgs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "contracts"))
    from kvpeer import FAST, SHAPE, PeerProcess, skip_reason

    if skip_reason("shm"):
        pytest.skip(str(skip_reason("shm")))
    decode = PeerProcess("decode", "shm", SHAPE, FAST)  # its pool lives in /dev/shm and is offered
    backend = create_backend("shm")
    try:
        pool = SHAPE.pool()
        monkeypatch.setattr(shm, "device_regions", lambda regions: [(a, n, 0) for a, n in regions])
        backend.register(KVArgs.from_pool(pool).regions())
        peer = backend.connect(base64.b64decode(decode.info["endpoint"]))
        assert backend.path_of(peer) == "tcp"  # type: ignore[attr-defined]
    finally:
        backend.close()
        decode.close()
