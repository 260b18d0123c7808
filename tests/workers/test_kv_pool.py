import pytest

from workers.kv_pool import KVPool


def make_pool(**kw: int) -> KVPool:
    args = dict(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, num_aux_slots=4)
    args.update(kw)
    return KVPool(**args)  # type: ignore[arg-type]


def test_alloc_free_roundtrip_and_exhaustion() -> None:
    pool = make_pool()
    a = pool.alloc(5)
    assert a is not None and len(set(a)) == 5
    assert pool.alloc(4) is None, "short pool must give nothing rather than part"
    assert pool.num_free_pages == 3
    pool.free(a)
    assert pool.num_free_pages == 8
    assert pool.pages_for(9) == 3 and pool.pages_for(8) == 2 and pool.pages_for(0) == 0


def test_double_free_and_bad_ids_are_rejected() -> None:
    pool = make_pool()
    pages = pool.alloc(8)
    assert pages is not None
    pool.free(pages)
    with pytest.raises(RuntimeError):
        pool.free([0])
    with pytest.raises(ValueError):
        pool.free([99])


def test_buffers_are_per_layer_k_then_v_with_page_sized_items() -> None:
    pool = make_pool()
    bufs = pool.kv_buffers()
    assert len(bufs) == 4 and bufs[0] is pool.k[0] and bufs[2] is pool.v[0]
    assert pool.kv_item_lens() == [4 * 2 * 8 * 4] * 4
    assert pool.kv_data_lens() == [8 * 4 * 2 * 8 * 4] * 4
    assert len(set(pool.kv_ptrs())) == 4
    # one page of one buffer is one contiguous run of page_bytes at ptr + page * page_bytes
    pool.page_view(1, 3)[:] = 7
    assert pool.k[1][3].view("uint8").min() == 7 and pool.k[1][2].view("uint8").max() == 0


def test_aux_slots_and_validation() -> None:
    pool = make_pool()
    slots = [pool.alloc_aux() for _ in range(4)]
    assert None not in slots and pool.alloc_aux() is None
    for s in slots:
        assert s is not None
        pool.free_aux(s)
    assert pool.num_free_aux_slots == 4
    with pytest.raises(ValueError):
        make_pool(num_pages=0)
    with pytest.raises(ValueError):
        KVPool(num_layers=1, num_pages=1, page_size=1, num_kv_heads=1, head_dim=1, dtype="int7")


def test_a_shared_pool_lives_in_one_file_in_dev_shm() -> None:
    """--same-host-kv auto on a decode: every K/V buffer and the aux slots are views of one /dev/shm file,
    so a co-located prefill mapping that file writes straight into the pool."""
    import mmap
    import os

    import numpy as np

    from transfer.shm_files import mapping_of

    pool = KVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, num_aux_slots=4,
                  shared=True)
    try:
        path = pool.shared_file.path
        assert path.startswith("/dev/shm/") and os.path.exists(path)
        for addr in [*pool.kv_ptrs(), int(pool.aux.ctypes.data)]:
            found = mapping_of(addr)
            assert found is not None and found.path == path
        other = mmap.mmap(os.open(path, os.O_RDWR), 0)  # another mapping of the file: same memory
        offset = mapping_of(pool.kv_ptrs()[3]).file_offset(pool.kv_ptrs()[3])  # type: ignore[union-attr]
        other[offset : offset + 4] = b"\x01\x02\x03\x04"
        assert bytes(pool.page_view(3, 0)[:4]) == b"\x01\x02\x03\x04"
        assert not np.delete(np.stack([pool.page_view(b, 0) for b in range(4)]), 3, axis=0).any()
        other.close()
    finally:
        pool.close()
    assert not os.path.exists(path)


def test_a_shared_pool_falls_back_to_private_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """A /dev/shm too small (a container's 64 MiB) or missing: private memory, no same-host offer."""
    import errno

    from transfer import shm_files

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_files.SharedFile, "create", full)
    pool = make_pool(shared=True)  # type: ignore[arg-type]
    assert pool.shared_file is None
    assert pool.alloc(8) is not None and pool.k[0].shape == (8, 4, 2, 8)


def test_same_host_kv_flag_is_validated() -> None:
    from workers.config import ConfigError, WorkerConfig

    assert WorkerConfig(same_host_kv="off").same_host_kv == "off"
    with pytest.raises(ConfigError, match="same_host_kv"):
        WorkerConfig(same_host_kv="sometimes")
