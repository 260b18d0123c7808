"""The worker's paged KV pool: real memory, one buffer per layer for K and one for V.

Lifecycle:
1. The worker builds one ``KVPool`` at startup from the engine's model shape; the buffers never move,
   so the transfer backend registers their addresses once (``kv_buffers()``).
2. The scheduler allocates page ids with ``alloc(n)`` (None when the pool is short) and returns them
   with ``free(pages)``; every request path (finish, error, abort, timeout) ends in ``free``.
3. Engines read and write the buffers in place (numpy here; the torch engine wraps the same memory
   with ``torch.from_numpy``), the transfer layer writes into them from other processes.
   With ``device="cuda"`` (GPU engines) the buffers are torch tensors in device memory instead and
   ``kv_ptrs()`` gives their device addresses; ``page_view`` is host-only.
   With ``shared=True`` (a decode whose co-located prefills may copy into it, ``transfer.shm``) the host
   buffers and the aux slots live in one file in ``/dev/shm`` instead of private memory; ``close()``
   unlinks it (a crashed worker's file is swept by the next pool made on the machine).

Page layout of one buffer: ``[num_pages, page_size, num_kv_heads, head_dim]``, so one page of one
layer is one contiguous block of ``page_bytes`` bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# numpy has no bfloat16: it is stored as raw 16-bit words and viewed by the engine.
_NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "uint8": np.uint8}


class KVPool:
    """Per-layer K and V page buffers plus a free-page list and a slot buffer for aux data."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "float32",
        num_aux_slots: int = 256,
        aux_slot_bytes: int = 4096,
        device: str = "cpu",
        shared: bool = False,
    ) -> None:
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"kv dtype {dtype!r} is not one of {sorted(_NUMPY_DTYPES)}")
        for name, value in (
            ("num_layers", num_layers),
            ("num_pages", num_pages),
            ("page_size", page_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("num_aux_slots", num_aux_slots),
            ("aux_slot_bytes", aux_slot_bytes),
        ):
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        np_dtype = _NUMPY_DTYPES[dtype]
        self.device = device
        self.shared_file: Any = None  # transfer.shm_files.SharedFile when shared
        aux_shape = (num_aux_slots, aux_slot_bytes)
        if device == "cpu" and shared:
            try:
                self.k, self.v, self.aux = self._shared_buffers(shape, np.dtype(np_dtype), num_layers, aux_shape)
            except OSError as exc:  # e.g. a container's small /dev/shm: private memory, no same-host path
                log.warning("KV pool: shared memory unavailable (%s); using private memory", exc)
                shared = False
        if device != "cpu":
            self.k, self.v = _device_buffers(shape, dtype, device, num_layers)
            self.aux = np.zeros(aux_shape, dtype=np.uint8)
        elif not shared:
            self.k = [np.zeros(shape, dtype=np_dtype) for _ in range(num_layers)]
            self.v = [np.zeros(shape, dtype=np_dtype) for _ in range(num_layers)]
            self.aux = np.zeros(aux_shape, dtype=np.uint8)
        self.page_bytes = int(self.k[0][0].nbytes)
        self.token_bytes = self.page_bytes // page_size
        self.aux_slot_bytes = aux_slot_bytes
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages  # per page: 1 while in ``_free_pages``
        self._free_slots: list[int] = list(range(num_aux_slots - 1, -1, -1))

    def _shared_buffers(
        self, shape: tuple[int, ...], np_dtype: np.dtype[Any], num_layers: int, aux_shape: tuple[int, int]
    ) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
        """K, V and aux as views of one shared-memory file (each buffer page-aligned in it)."""
        from transfer.shm_files import SharedFile

        align = 4096
        buf_bytes = int(np.prod(shape)) * np_dtype.itemsize
        stride = -(-buf_bytes // align) * align
        aux_at = 2 * num_layers * stride
        self.shared_file = SharedFile.create("pd-kv-pool-", aux_at + aux_shape[0] * aux_shape[1], allocate=True)
        mm = self.shared_file.mm
        views = [np.frombuffer(mm, np_dtype, int(np.prod(shape)), i * stride).reshape(shape)
                 for i in range(2 * num_layers)]
        aux = np.frombuffer(mm, np.uint8, aux_shape[0] * aux_shape[1], aux_at).reshape(aux_shape)
        return views[:num_layers], views[num_layers:], aux

    def close(self) -> None:
        """Unlink a shared pool's file (the memory stays mapped while anything uses it). Idempotent."""
        if self.shared_file is not None:
            self.shared_file.close()

    # -- pages -------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def pages_for(self, num_tokens: int) -> int:
        """Pages needed to hold ``num_tokens`` positions."""
        return -(-num_tokens // self.page_size)

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take ``num_pages`` free pages, or None (nothing taken) if the pool has fewer."""
        if num_pages < 0:
            raise ValueError("num_pages must be >= 0")
        if num_pages > len(self._free_pages):
            return None
        taken = self._free_pages[len(self._free_pages) - num_pages :]
        del self._free_pages[len(self._free_pages) - num_pages :]
        for page in taken:
            self._is_free[page] = 0
        taken.reverse()
        return taken

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool: all of them, or (ValueError for an id out of range, RuntimeError for a page
        already free or named twice) none: a failed call changes nothing, so no page is ever listed free twice
        (two requests would then be given the same page)."""
        pages = list(pages)
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"page id {page} out of range")
        if len(set(pages)) != len(pages) or any(self._is_free[page] for page in pages):
            raise RuntimeError(f"KV pool double free: a page of {pages} is already free")
        for page in pages:
            self._is_free[page] = 1
        self._free_pages.extend(pages)

    # -- aux slots ---------------------------------------------------------------------------
    @property
    def num_free_aux_slots(self) -> int:
        return len(self._free_slots)

    def alloc_aux(self) -> int | None:
        return self._free_slots.pop() if self._free_slots else None

    def free_aux(self, slot: int) -> None:
        if not 0 <= slot < self.aux.shape[0]:
            raise ValueError(f"aux slot {slot} out of range")
        self._free_slots.append(slot)

    # -- memory for the transfer layer -------------------------------------------------------
    def kv_buffers(self) -> list[np.ndarray]:
        """All K layer buffers, then all V layer buffers (the order the transfer layer uses)."""
        return [*self.k, *self.v]

    def kv_ptrs(self) -> list[int]:
        if self.device != "cpu":
            tensors: list[Any] = self.kv_buffers()
            return [int(buf.data_ptr()) for buf in tensors]
        return [int(buf.ctypes.data) for buf in self.kv_buffers()]

    def kv_data_lens(self) -> list[int]:
        return [int(buf.nbytes) for buf in self.kv_buffers()]

    def kv_item_lens(self) -> list[int]:
        return [self.page_bytes] * (2 * self.num_layers)

    def page_view(self, buffer_index: int, page: int) -> np.ndarray:
        """Raw bytes of one page of one buffer (K layers first, then V layers)."""
        if self.device != "cpu":
            raise RuntimeError(f"page_view needs host memory; this pool lives on {self.device}")
        return self.kv_buffers()[buffer_index][page].view(np.uint8).reshape(-1)


def _device_buffers(shape: tuple[int, ...], dtype: str, device: str, num_layers: int) -> tuple[list[Any], list[Any]]:
    """Per-layer K and V buffers as torch tensors on ``device`` (e.g. GPU memory for flashinfer)."""
    import torch

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "uint8": torch.uint8}
    k = [torch.zeros(shape, dtype=torch_dtype[dtype], device=device) for _ in range(num_layers)]
    v = [torch.zeros(shape, dtype=torch_dtype[dtype], device=device) for _ in range(num_layers)]
    return k, v
