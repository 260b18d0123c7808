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
