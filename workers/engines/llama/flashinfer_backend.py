"""Attention with flashinfer's paged prefill kernel (CUDA only; flashinfer is imported lazily).

One ``BatchPrefillWithPagedKVCacheWrapper`` serves the whole mixed batch: decode rows are
sequences with one query row. Its causal mask is aligned bottom-right (query i of a sequence with
q queries and k keys sits at position k - q + i), which is what chunked prefill and prefix hits
need. The caches are the pool's per-layer ``[pages, page_size, kv_heads, head_dim]`` tensors (NHD),
so the pool must live on the GPU (``KVPool(..., device="cuda")``).

Not exercised on the CPU-only development machines: ``tests/engines/test_flashinfer.py`` (marked
``gpu``) compares it with the SDPA backend where a GPU and flashinfer are present.
"""

from __future__ import annotations

from typing import Any

import torch

from workers.engines.llama.attention import AttentionBackend, StepLayout

WORKSPACE_BYTES = 128 * 1024 * 1024


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"the flashinfer attention backend needs a CUDA device, not {device}")
        try:
            import flashinfer
        except ImportError as exc:
            raise ImportError(
                "attention backend 'flashinfer' needs the flashinfer-python package; "
                "install it or use --attention torch_sdpa"
            ) from exc
        self._device = device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._wrapper: Any = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._step: StepLayout | None = None

    def plan(self, step: StepLayout) -> None:
        page_size = self.page_size
        qo_indptr = [0]
        kv_indptr = [0]
        kv_indices: list[int] = []
        last_page_len: list[int] = []
        for q_len, kv_len, pages in zip(step.query_lens, step.kv_lens, step.page_ids, strict=True):
            used = -(-kv_len // page_size)
            kv_indices.extend(pages[:used])
            qo_indptr.append(qo_indptr[-1] + q_len)
            kv_indptr.append(kv_indptr[-1] + used)
            last_page_len.append(kv_len - (used - 1) * page_size)

        def i32(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self._device)

        dtype = self.k_caches[0].dtype
        self._wrapper.plan(
            i32(qo_indptr),
            i32(kv_indptr),
            i32(kv_indices),
            i32(last_page_len),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            page_size,
            causal=True,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        self._step = step

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before run()"
        self.store(layer, step, k, v)
        out: torch.Tensor = self._wrapper.run(q.contiguous(), (self.k_caches[layer], self.v_caches[layer]))
        return out
