"""The attention seam: paged-KV attention for one engine step, behind one small interface.

Lifecycle:
1. The engine makes a backend (``make_backend(name, device)``) and calls ``bind(...)`` once with
   per-layer K and V caches shaped ``[num_pages, page_size, num_kv_heads, head_dim]`` (the
   worker's ``KVPool`` memory, wrapped zero-copy).
2. Once per step the engine calls ``plan(step)`` with the step's ``StepLayout``.
3. For every layer the model calls ``run(layer, q, k, v)``: the backend stores the new K/V rows at
   ``step.write_slots`` and returns attention over each sequence's keys 0..kv_len-1, causally
   aligned bottom-right (query i of a sequence is at position ``kv_len - query_len + i``).

Backends: ``torch_sdpa`` (CPU default, ``workers.engines.llama.sdpa``) and ``flashinfer`` (GPU,
imported lazily, ``workers.engines.llama.flashinfer_backend``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

BACKEND_NAMES = ("torch_sdpa", "flashinfer")


@dataclass
class StepLayout:
    """Where one step's query rows come from and which cache slots they attend to / write."""

    query_lens: list[int]  # rows per sequence, consecutive in the flattened batch
    kv_lens: list[int]  # keys per sequence (positions 0..kv_len-1, including this step's)
    page_ids: list[list[int]]  # page table per sequence
    write_slots: torch.Tensor  # flat slot (page * page_size + row) per written row, int64
    write_rows: torch.Tensor | None  # rows of the batch that write KV; None = every row

    @property
    def num_rows(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(ABC):
    """Paged attention over the worker's KV pool for mixed prefill/decode batches."""

    name: str = "attention"

    def bind(self, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor], num_heads: int) -> None:
        """Attach the caches (one ``[pages, page_size, kv_heads, head_dim]`` tensor per layer)."""
        self.k_caches = k_caches
        self.v_caches = v_caches
        self.num_heads = num_heads
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = k_caches[0].shape
        # Flat views: slot s = page * page_size + row.
        self.k_flat = [k.view(-1, self.num_kv_heads, self.head_dim) for k in k_caches]
        self.v_flat = [v.view(-1, self.num_kv_heads, self.head_dim) for v in v_caches]

    @abstractmethod
    def plan(self, step: StepLayout) -> None:
        """Prepare per-step metadata; called once per step before the layers run."""

    @abstractmethod
    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store ``k``/``v`` ``[T, kv_heads, head_dim]`` and attend ``q`` ``[T, heads, head_dim]``.

        Returns ``[T, heads, head_dim]``.
        """

    def store(self, layer: int, step: StepLayout, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write the step's new K/V rows into the cache slots the scheduler gave them."""
        if step.write_rows is not None:
            k = k.index_select(0, step.write_rows)
            v = v.index_select(0, step.write_rows)
        self.k_flat[layer].index_copy_(0, step.write_slots, k)
        self.v_flat[layer].index_copy_(0, step.write_slots, v)


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """``auto`` picks flashinfer on CUDA when importable, else torch SDPA."""
    if name in ("auto", ""):
        if device.type == "cuda":
            try:
                import flashinfer  # noqa: F401
            except ImportError:
                name = "torch_sdpa"
            else:
                name = "flashinfer"
        else:
            name = "torch_sdpa"
    if name in ("torch_sdpa", "sdpa"):
        from workers.engines.llama.sdpa import SdpaBackend

        return SdpaBackend()
    if name == "flashinfer":
        from workers.engines.llama.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(device)
    raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKEND_NAMES)}")
