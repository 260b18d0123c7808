"""``KVPool.free`` either frees every page it is given or none: a double free is refused whether or not the
pool is full, and a refused call leaves the free list as it was, so no page is ever listed free twice (two
requests would then be given the same page and write each other's KV)."""

import pytest

from workers.kv_pool import KVPool


def make_pool() -> KVPool:
    return KVPool(num_layers=1, num_pages=4, page_size=4, num_kv_heads=1, head_dim=4, num_aux_slots=1)


def test_a_double_free_in_a_pool_that_is_not_full_is_refused() -> None:
    pool = make_pool()
    pages = pool.alloc(2)
    assert pages is not None
    pool.free([pages[0]])
    with pytest.raises(RuntimeError):
        pool.free([pages[0]])  # (4 - 2 + 1 + 1 = 4 free: the count alone does not tell)
    pool.free([pages[1]])
    taken = pool.alloc(4)
    assert taken is not None and sorted(taken) == [0, 1, 2, 3]


def test_a_refused_double_free_changes_nothing() -> None:
    pool = make_pool()
    pages = pool.alloc(4)
    assert pages is not None
    pool.free(pages)
    with pytest.raises(RuntimeError):
        pool.free([pages[0]])
    assert pool.num_free_pages == 4
    taken = pool.alloc(4)
    assert taken is not None and len(set(taken)) == 4
    assert pool.alloc(1) is None


def test_a_page_named_twice_in_one_call_is_refused_and_nothing_is_freed() -> None:
    pool = make_pool()
    pages = pool.alloc(4)
    assert pages is not None
    with pytest.raises(RuntimeError):
        pool.free([pages[0], pages[0]])
    assert pool.num_free_pages == 0


def test_a_bad_id_after_good_ones_frees_none_of_them() -> None:
    pool = make_pool()
    pages = pool.alloc(2)
    assert pages is not None
    with pytest.raises(ValueError):
        pool.free([pages[0], 99])
    assert pool.num_free_pages == 2
    pool.free(pages)  # the caller may free them once more: no duplicates result
    taken = pool.alloc(4)
    assert taken is not None and len(set(taken)) == 4
