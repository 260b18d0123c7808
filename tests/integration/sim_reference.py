"""In-process reference for sim-engine outputs: what a correct P->D run must produce."""

from __future__ import annotations

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.sim import SimEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams


def expected_tokens(prompt: list[int], max_tokens: int, prefill_salt: int = 0, verify_kv: bool = True) -> list[int]:
    """Prefill (optionally with salted KV) then decode unsalted on the same memory."""
    verify = {"verify_kv": "1" if verify_kv else "0"}
    decode = SimEngine(EngineOptions(extra=verify))
    prefill = SimEngine(EngineOptions(extra={"kv_salt": str(prefill_salt), **verify}))
    info = decode.info
    pool = KVPool(num_layers=info.num_layers, num_pages=512, page_size=4, num_kv_heads=info.num_kv_heads,
                  head_dim=info.head_dim)
    decode.bind(pool)
    prefill.bind(pool)
    pages = pool.alloc(pool.pages_for(len(prompt) + max_tokens))
    assert pages is not None
    (out,) = prefill.forward([SeqInput(0, pages, 0, prompt, True, SamplingParams())])
    seq, tokens = list(prompt), [out.token_id]
    while len(tokens) < max_tokens:
        seq.append(tokens[-1])  # type: ignore[arg-type]
        (out,) = decode.forward([SeqInput(0, pages, len(seq) - 1, [seq[-1]], True, SamplingParams())])
        tokens.append(out.token_id)
    return [t for t in tokens if t is not None]


def text_of(tokens: list[int]) -> str:
    return bytes(tokens).decode()
