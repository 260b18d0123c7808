"""flashinfer against torch SDPA on a GPU, same weights, same mixed batches (skips without a GPU)."""

from __future__ import annotations

import pytest
import torch

from workers.engines.base import EngineOptions, SeqInput
from workers.engines.llama import TorchEngine
from workers.kv_pool import KVPool
from workers.protocol import SamplingParams

pytestmark = pytest.mark.gpu


def _engine(path: str, attention: str) -> tuple[TorchEngine, KVPool]:
    engine = TorchEngine(EngineOptions(model=path, device="cuda", dtype="float16", attention=attention))
    info = engine.info
    pool = KVPool(
        num_layers=info.num_layers,
        num_pages=64,
        page_size=16,
        num_kv_heads=info.num_kv_heads,
        head_dim=info.head_dim,
        dtype="float16",
        device="cuda",
    )
    engine.bind(pool)
    return engine, pool


@pytest.mark.parametrize("variant", ["llama", "qwen3"])
def test_flashinfer_matches_sdpa(variant, tiny_model) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    pytest.importorskip("flashinfer")
    path = tiny_model(variant).path
    gen = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(3, 512, (n,), generator=gen).tolist() for n in (13, 30, 40))
    greedy = SamplingParams(temperature=0.0)
    # Step 1 caches prefixes; step 2 mixes a fresh prefill, a chunk after a cached prefix (not
    # page-aligned) and a decode-like single token after 39 cached positions.
    step1 = [
        SeqInput(2, [10, 11], 0, b[:17], False, greedy),
        SeqInput(3, [20, 21, 22], 0, c[:39], False, greedy),
    ]
    step2 = [
        SeqInput(1, [1], 0, a, True, greedy),
        SeqInput(2, [10, 11], 17, b[17:], True, greedy),
        SeqInput(3, [20, 21, 22], 39, c[39:], True, greedy),
    ]
    results = {}
    for attention in ("torch_sdpa", "flashinfer"):
        engine, pool = _engine(path, attention)
        assert engine.attention.name == attention
        engine.forward(step1)
        out = engine.forward(step2)
        logits = [x.float().cpu() for x in engine.last_logits if x is not None]
        results[attention] = ([o.token_id for o in out], logits, [k.float().cpu() for k in pool.k])
    sdpa, fi = results["torch_sdpa"], results["flashinfer"]
    for x, y in zip(sdpa[1], fi[1], strict=True):
        assert (x - y).abs().max().item() < 2e-2  # float16 activations, different kernels
    for x, y in zip(sdpa[2], fi[2], strict=True):
        assert (x - y).abs().max().item() < 2e-2
    assert sdpa[0] == fi[0]
