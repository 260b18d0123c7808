"""Logit adjustments from a request's own settings and history: logit_bias, penalties, min_new_tokens.

Applied to the raw logits of the sequences a step samples, in this order, before the temperature and
the filters of ``sampling.py`` (reported logprobs stay those of the raw logits):
1. ``logit_bias``: ``bias[token]`` is added to the token's logit.
2. ``repetition_penalty`` r (as in transformers, SGLang and vLLM): every token that occurs in the
   prompt or the output so far has its logit divided by r when positive, multiplied by r otherwise.
3. ``frequency_penalty`` f and ``presence_penalty`` p (OpenAI's formula):
   ``logit -= count * f + (count > 0) * p``, ``count`` = the token's occurrences in the output so far
   (the prompt is not counted).
4. ``min_new_tokens`` m: while fewer than m outputs exist, EOS (unless ``ignore_eos``) and every
   ``stop_token_ids`` entry are at -inf.

"The output so far" is every token after the prompt the client sent: on a decode worker it includes
the first token, sampled on the prefill; for a migrated stream (``output_offset`` k) the last k tokens
of the prompt it was resubmitted with. So a request split across prefill and decode (or migrated)
samples what one engine would.

Lifecycle (one ``LogitAdjuster`` per engine; every call from the scheduler thread):
1. ``adjust(logits, seqs)`` once per step for the sequences it samples (one row each). A sequence with
   a repetition, presence or frequency penalty has a record in a slot: a row of a ``[slots, vocab]``
   seen-token mask (prompt or output), a row of ``[slots, vocab]`` output counts, and the distinct
   tokens it has seen, in order, in a row of ``[slots, capacity]`` ids. The record is built from
   ``all_token_ids`` at the sequence's first sample in this engine, then extended by the tokens each
   step feeds (one mask gather for the whole batch finds the new distinct ones). The penalties then
   touch only the seen tokens: one gather of their logits and counts for every penalised row at once,
   the formulas on that flat vector, one scatter back — O(distinct tokens), not O(batch x vocab).
   ``logit_bias`` and ``min_new_tokens`` are one ``index_put`` each. Returns new logits, or the input
   when no row asks for anything.
2. ``forget(seq_id)`` when the scheduler releases a sequence clears the entries its record set and
   frees its slot. Records are also bounded (``MAX_RECORDS``, least recently used first): one evicted
   while live is rebuilt from ``all_token_ids`` at its next step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from workers.engines.base import SeqInput, banned_by_min_tokens, needs_history
from workers.engines.llama.sampling import GREEDY_TEMPERATURE

MAX_RECORDS = 1024  # penalised sequences whose counts are kept at once


@dataclass
class _Record:
    slot: int  # row of the record tensors
    length: int  # history tokens counted (positions 0..length-1)
    output_start: int  # history index where the output begins


class LogitAdjuster:
    """Applies the four adjustments to a step's logits, keeping per-sequence counts between steps."""

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self._records: OrderedDict[int, _Record] = OrderedDict()
        self._free: list[int] = []
        self._seen = torch.zeros(0, vocab_size, dtype=torch.bool)  # [slots, vocab]: in the prompt or output
        self._counts = torch.zeros(0, vocab_size, dtype=torch.float32)  # [slots, vocab]: output occurrences
        self._ids = torch.zeros(0, 0, dtype=torch.int64)  # [slots, capacity]: distinct seen tokens, in order
        self._num_ids: list[int] = []  # per slot: valid entries of its ``_ids`` row

    @property
    def num_records(self) -> int:
        return len(self._records)

    def forget(self, seq_id: int) -> None:
        record = self._records.pop(seq_id, None)
        if record is None:
            return
        slot, n = record.slot, self._num_ids[record.slot]
        ids = self._ids[slot, :n]
        self._seen[slot, ids] = False  # only what this record set: O(its distinct tokens)
        self._counts[slot, ids] = 0.0
        self._num_ids[slot] = 0
        self._free.append(slot)

    def adjust(self, logits: torch.Tensor, seqs: list[SeqInput]) -> torch.Tensor:
        """``logits`` ``[len(seqs), vocab]`` (float32) with each row's adjustments applied."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        pen_rows: list[int] = []
        pen_seqs: list[SeqInput] = []
        for row, seq in enumerate(seqs):
            p = seq.params
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_ids += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
            if needs_history(p):
                pen_rows.append(row)
                pen_seqs.append(seq)
            if p.min_new_tokens:
                banned = banned_by_min_tokens(p, seq.num_generated + p.output_offset, self.eos_token_ids)
                ban_rows += [row] * len(banned)
                ban_ids += banned
        if not (bias_rows or pen_rows or ban_rows):
            return logits
        device = logits.device
        out = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)
        if bias_rows:
            index = (torch.tensor(bias_rows, device=device), torch.tensor(bias_ids, device=device))
            out.index_put_(index, torch.tensor(bias_values, dtype=torch.float32, device=device), accumulate=True)
        if pen_rows:
            self._penalize(out, pen_rows, pen_seqs)
        if ban_rows:
            index = (torch.tensor(ban_rows, device=device), torch.tensor(ban_ids, device=device))
            out.index_put_(index, torch.tensor(float("-inf"), device=device))
        return out

    # -- penalties -----------------------------------------------------------------------------
    def _penalize(self, out: torch.Tensor, rows: list[int], seqs: list[SeqInput]) -> None:
        """Repetition, frequency and presence penalties on the seen tokens of ``rows``, in place."""
        device = out.device
        if self._counts.device != device:
            self._seen, self._counts, self._ids = (t.to(device) for t in (self._seen, self._counts, self._ids))
        slots = self._sync(seqs)
        sizes = [self._num_ids[slot] for slot in slots]
        if not sum(sizes):
            return
        vocab = self.vocab_size
        # One row per sequence (flat offsets of its logits row and counts row, r, f, p), expanded to one row per
        # seen token with a single repeat_interleave (float64 holds the offsets exactly).
        meta = torch.tensor([[row * vocab, slot * vocab, s.params.repetition_penalty, s.params.frequency_penalty,
                              s.params.presence_penalty] for row, slot, s in zip(rows, slots, seqs, strict=True)],
                            dtype=torch.float64, device=device)
        per_token = meta.repeat_interleave(torch.tensor(sizes, device=device), dim=0)
        cols = torch.cat([self._ids[slot, :n] for slot, n in zip(slots, sizes, strict=True)])
        at = per_token[:, 0].long() + cols  # flat positions: 1-d index_select / index_copy_ are the fast paths
        flat = out.view(-1)
        scores = flat.index_select(0, at)
        counts = self._counts.view(-1).index_select(0, per_token[:, 1].long() + cols)
        repetition, frequency, presence = per_token[:, 2:].to(torch.float32).unbind(1)
        penalised = torch.where(scores > 0, scores / repetition, scores * repetition)  # every seen token
        penalised = penalised - counts * frequency - (counts > 0).to(torch.float32) * presence
        # A penalty the API accepts can overflow float32 (a logit of 30 / 1e-40 is inf; 0 * a penalty of 1e39,
        # inf in float32, is NaN): such a score takes the end its sign points to (the formula's limit) of the range
        # that stays finite through any non-greedy temperature, else the row has no finite maximum and its
        # request fails. A score that was not finite stays so.
        limit = torch.finfo(torch.float32).max * GREEDY_TEMPERATURE  # (``filtered_logits`` divides by it)
        overflow = torch.isfinite(scores) & ~(penalised.abs() <= limit)  # (NaN too; no ``any()``: no device sync)
        penalised = torch.where(overflow, torch.sign(scores) * limit, penalised)
        flat.index_copy_(0, at, penalised)

    def _sync(self, seqs: list[SeqInput]) -> list[int]:
        """Bring every sequence's record up to its history; their slots, in order."""
        slots: list[int] = []
        new_slots: list[int] = []
        new_ids: list[int] = []
        output_slots: list[int] = []
        output_ids: list[int] = []
        for seq in seqs:
            end = seq.num_cached + len(seq.token_ids)
            output_start = end - seq.num_generated - seq.params.output_offset
            if output_start < 0:
                raise ValueError(f"rid {seq.rid}: {seq.num_generated} + output_offset outputs exceed its {end} tokens")
            record = self._records.get(seq.rid)
            if record is not None and (record.output_start != output_start or record.length > end):
                self.forget(seq.rid)  # not this sequence's history any more: recount
                record = None
            if record is None:
                record = self._new_record(seq.rid, output_start, seqs)
            else:
                self._records.move_to_end(seq.rid)
            new = self._new_tokens(seq, record.length, end)
            split = max(0, min(len(new), output_start - record.length))
            new_slots += [record.slot] * len(new)
            new_ids += new
            output_slots += [record.slot] * (len(new) - split)
            output_ids += new[split:]
            record.length = end
            slots.append(record.slot)
        device = self._counts.device
        if output_ids:
            index = (torch.tensor(output_slots, device=device), torch.tensor(output_ids, device=device))
            self._counts.index_put_(index, torch.ones(len(output_ids), device=device), accumulate=True)
        if new_ids:
            distinct = len(new_ids) == len(seqs) and len(set(new_slots)) == len(seqs)
            self._see(torch.tensor(new_slots, device=device), torch.tensor(new_ids, device=device), distinct)
        return slots

    def _see(self, slots: torch.Tensor, ids: torch.Tensor, distinct: bool) -> None:
        """Mark (slot, token) pairs seen; append the ones new to their slot to its distinct-token row.
        ``distinct``: no pair repeats (a decode step: one token per slot), so no de-duplication."""
        if not distinct:
            keys = torch.unique(slots * self.vocab_size + ids)  # sorted: grouped by slot
            slots, ids = keys // self.vocab_size, keys % self.vocab_size
        fresh = ~self._seen[slots, ids]
        slots, ids = slots[fresh], ids[fresh]
        if not len(ids):
            return
        self._seen[slots, ids] = True
        if distinct:
            groups, sizes = slots.tolist(), [1] * len(ids)
        else:
            unique, counts = torch.unique_consecutive(slots, return_counts=True)
            groups, sizes = unique.tolist(), counts.tolist()
        start = 0
        for slot, size in zip(groups, sizes, strict=True):
            n = self._num_ids[slot]
            if n + size > self._ids.shape[1]:
                grown = max(64, 2 * self._ids.shape[1], n + size)
                wider = torch.zeros(self._ids.shape[0], grown, dtype=torch.int64, device=self._ids.device)
                wider[:, : self._ids.shape[1]] = self._ids
                self._ids = wider
            self._ids[slot, n : n + size] = ids[start : start + size]
            self._num_ids[slot] = n + size
            start += size

    @staticmethod
    def _new_tokens(seq: SeqInput, start: int, end: int) -> list[int]:
        """History tokens at positions [start, end)."""
        if seq.all_token_ids is not None:
            if len(seq.all_token_ids) < end:
                raise ValueError(f"rid {seq.rid}: all_token_ids has {len(seq.all_token_ids)} tokens, needs {end}")
            return seq.all_token_ids[start:end]
        if start < seq.num_cached:
            raise ValueError(f"rid {seq.rid}: a penalty needs all_token_ids (the engine has no record of its history)")
        return seq.token_ids[start - seq.num_cached :]

    def _new_record(self, seq_id: int, output_start: int, batch: list[SeqInput]) -> _Record:
        if len(self._records) >= MAX_RECORDS:  # the least recent go, never one of this batch's (its slot is in use)
            in_batch = {seq.rid for seq in batch}
            excess, victims = len(self._records) - MAX_RECORDS + 1, []
            for rid in self._records:  # (oldest first; a batch past MAX_RECORDS grows the tensors instead)
                if rid not in in_batch:
                    victims.append(rid)
                    if len(victims) == excess:
                        break
            for rid in victims:
                self.forget(rid)
        if not self._free:
            old = self._counts.shape[0]
            grown = max(8, 2 * old)
            device = self._counts.device
            self._seen = torch.cat([self._seen, torch.zeros(grown - old, self.vocab_size, dtype=torch.bool,
                                                            device=device)])
            self._counts = torch.cat([self._counts, torch.zeros(grown - old, self.vocab_size, device=device)])
            self._ids = torch.cat([self._ids, torch.zeros(grown - old, self._ids.shape[1], dtype=torch.int64,
                                                          device=device)])
            self._num_ids += [0] * (grown - old)
            self._free += range(grown - 1, old - 1, -1)
        record = _Record(self._free.pop(), 0, output_start)  # a free slot's rows are clear (``forget``)
        self._records[seq_id] = record
        return record
