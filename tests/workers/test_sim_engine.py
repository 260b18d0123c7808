from workers.engines.base import SeqInput
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams


def setup() -> tuple[SimEngine, KVPool]:
    engine = SimEngine()
    info = engine.info
    pool = KVPool(num_layers=info.num_layers, num_pages=32, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    engine.bind(pool)
    return engine, pool


def prefill(engine: SimEngine, pages: list[int], tokens: list[int], chunk: int) -> int:
    token = None
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        last = start + chunk >= len(tokens)
        (out,) = engine.forward([SeqInput(1, pages, start, part, last, SamplingParams())])
        token = out.token_id
    assert token is not None
    return token


def test_chunking_and_page_ids_do_not_change_kv_or_output() -> None:
    engine, pool = setup()
    tokens = list(range(40, 63))
    a, b = pool.alloc(6), pool.alloc(6)
    assert a and b
    t1 = prefill(engine, a, tokens, chunk=23)
    t2 = prefill(engine, list(reversed(b)), tokens, chunk=5)
    assert t1 == t2
    assert engine.verify(a, tokens) and engine.verify(list(reversed(b)), tokens)
    assert engine.digest(a, len(tokens)) == engine.digest(list(reversed(b)), len(tokens))


def test_output_depends_on_the_kv_bytes_held() -> None:
    engine, pool = setup()
    tokens = list(range(70, 90))
    pages = pool.alloc(6)
    assert pages
    prefill(engine, pages, tokens, chunk=8)
    before = engine.digest(pages, len(tokens))

    def first_sample(rid: int) -> int | None:
        """What a worker seeing this sequence for the first time (a decode after import) samples."""
        out = engine.forward([SeqInput(rid, pages, len(tokens) - 1, [tokens[-1]], True, SamplingParams())])
        return out[0].token_id

    outs = {first_sample(100)}
    pool.v[2][pages[1], 2, 1, 3] += 1.0  # one value of one layer of one earlier position
    assert not engine.verify(pages, tokens)
    assert engine.digest(pages, len(tokens)) != before
    # different bytes -> a different digest -> (almost always) a different token; try a few positions
    changed = set()
    for flip in range(4):
        pool.k[0][pages[0], flip, 0, 0] += 3.0
        changed.add(first_sample(200 + flip))
    assert changed - outs, "output never changed although the KV did"


def test_incremental_sampling_digest_equals_a_full_read() -> None:
    engine, pool = setup()
    pages = pool.alloc(8)
    assert pages
    seq = list(range(40, 47))
    (out,) = engine.forward([SeqInput(1, pages, 0, seq, True, SamplingParams())])
    for _ in range(12):
        seq.append(out.token_id)  # type: ignore[arg-type]
        (out,) = engine.forward([SeqInput(1, pages, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        (fresh,) = engine.forward([SeqInput(99, pages, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        engine._seen.pop(99)
        assert out.token_id == fresh.token_id


def test_salted_kv_differs() -> None:
    from workers.engines.base import EngineOptions

    plain, pool = setup()
    salted = SimEngine(EngineOptions(extra={"kv_salt": "5"}))
    salted.bind(pool)
    tokens = [1, 2, 3, 4, 5]
    pages = pool.alloc(2)
    assert pages
    prefill(salted, pages, tokens, chunk=5)
    assert salted.verify(pages, tokens) and not plain.verify(pages, tokens)


def test_verify_kv_off_writes_no_kv_and_stays_deterministic() -> None:
    import numpy as np
    import pytest

    from workers.engines.base import EngineOptions, KVChecker

    fast = SimEngine(EngineOptions(extra={"verify_kv": "0"}))
    info = fast.info
    pool = KVPool(num_layers=info.num_layers, num_pages=32, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    fast.bind(pool)
    tokens = list(range(40, 63))
    a, b = pool.alloc(12), pool.alloc(12)
    assert a and b
    # chunking and page ids do not matter; the pool is left as it was
    first = {prefill(fast, a, tokens, chunk=23), prefill(fast, list(reversed(b)), tokens, chunk=5)}
    assert len(first) == 1
    assert all(not np.any(buf) for buf in pool.kv_buffers())
    # decode steps chain from the previous token and its position, whoever samples them first
    seq = [*tokens, first.pop()]
    for rid in (1, 2):
        (out,) = fast.forward([SeqInput(rid, a, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        (other,) = fast.forward([SeqInput(7, b, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        assert out.token_id == other.token_id
    outputs = []
    for _ in range(16):
        (out,) = fast.forward([SeqInput(1, a, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        assert out.token_id is not None
        seq.append(out.token_id)
        outputs.append(out.token_id)
    assert len(set(outputs)) > 3, "the chain must not collapse to one letter"
    # still a KV checker, answering "not checked"
    assert isinstance(fast, KVChecker)
    assert fast.verify(a, tokens) is None and fast.digest(a, len(tokens)) is None
    with pytest.raises(ValueError, match="verify_kv"):
        SimEngine(EngineOptions(extra={"verify_kv": "maybe"}))
