"""Attention with ``torch.nn.functional.scaled_dot_product_attention`` over gathered pages (CPU).

Each step: single-token sequences (decode) are gathered into one padded batch with a key-length
mask and run in one SDPA call per layer; multi-token sequences (prefill chunks) run one call each,
with a bottom-right aligned causal mask when part of their prefix is already cached (``is_causal``
aligns top-left, which is only right for a fresh prefill).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from workers.engines.llama.attention import AttentionBackend, StepLayout


@dataclass
class _Prefill:
    rows: slice
    slots: torch.Tensor  # [kv_len]
    mask: torch.Tensor | None  # [q_len, kv_len] bool, None = plain causal (q_len == kv_len)


@dataclass
class _DecodeGroup:
    rows: torch.Tensor  # [B] row per sequence
    slots: torch.Tensor  # [B, max_kv_len]
    mask: torch.Tensor  # [B, 1, 1, max_kv_len] bool


class SdpaBackend(AttentionBackend):
    name = "torch_sdpa"

    def __init__(self) -> None:
        self._step: StepLayout | None = None
        self._prefills: list[_Prefill] = []
        self._decode: _DecodeGroup | None = None

    def _slot_table(self, tables: list[list[int]], kv_lens: list[int]) -> torch.Tensor:
        """Flat cache slots ``[N, max_kv_len]`` for N sequences (padding reads slot 0; see ``plan``)."""
        device = self.k_flat[0].device
        ps = self.page_size
        width = -(-max(kv_lens) // ps)
        padded = [t[: -(-n // ps)] + [0] * (width - (-(-n // ps))) for t, n in zip(tables, kv_lens, strict=True)]
        table = torch.tensor(padded, dtype=torch.int64, device=device)
        offsets = torch.arange(ps, dtype=torch.int64, device=device)
        return (table[:, :, None] * ps + offsets).reshape(len(tables), -1)[:, : max(kv_lens)]

    def plan(self, step: StepLayout) -> None:
        device = self.k_flat[0].device
        self._step = step
        self._prefills = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        start = 0
        for q_len, kv_len, pages in zip(step.query_lens, step.kv_lens, step.page_ids, strict=True):
            if q_len == 1:
                decode_rows.append(start)
                decode_tables.append(pages)
                decode_lens.append(kv_len)
            else:
                mask = None
                if q_len != kv_len:
                    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)
                slots = self._slot_table([pages], [kv_len])[0]
                self._prefills.append(_Prefill(slice(start, start + q_len), slots, mask))
            start += q_len
        self._decode = None
        if decode_rows:
            slots = self._slot_table(decode_tables, decode_lens)
            lens = torch.tensor(decode_lens, device=device)
            mask = torch.arange(slots.shape[1], device=device)[None, :] < lens[:, None]
            # Padding (page 0's slots, the unwritten rows of a sequence's own last page) may hold an inf or
            # NaN another request left there, and its masked weight 0 times that is NaN: it reads the
            # sequence's own first slot instead, a finite value unless the sequence's own KV is not.
            slots = torch.where(mask, slots, slots[:, :1])
            self._decode = _DecodeGroup(
                rows=torch.tensor(decode_rows, dtype=torch.int64, device=device),
                slots=slots,
                mask=mask[:, None, None, :],
            )

    def run(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        step = self._step
        assert step is not None, "plan() must run before run()"
        self.store(layer, step, k, v)
        k_flat, v_flat = self.k_flat[layer], self.v_flat[layer]
        out = torch.empty_like(q)
        decode = self._decode
        if decode is not None:
            # [B, kv, H, D] -> [B, H, kv, D]
            keys = k_flat[decode.slots].transpose(1, 2)
            values = v_flat[decode.slots].transpose(1, 2)
            query = q.index_select(0, decode.rows)[:, :, None, :]  # [B, heads, 1, D]
            res = F.scaled_dot_product_attention(query, keys, values, attn_mask=decode.mask, enable_gqa=True)
            out.index_copy_(0, decode.rows, res[:, :, 0, :])
        for pre in self._prefills:
            keys = k_flat[pre.slots].transpose(0, 1)[None]  # [1, H_kv, kv, D]
            values = v_flat[pre.slots].transpose(0, 1)[None]
            query = q[pre.rows].transpose(0, 1)[None]  # [1, heads, q, D]
            res = F.scaled_dot_product_attention(
                query, keys, values, attn_mask=pre.mask, is_causal=pre.mask is None, enable_gqa=True
            )
            out[pre.rows] = res[0].transpose(0, 1)
        return out
