"""The ``sim`` engine: no model, a latency model, and a real KV pool whose bytes really move.

KV rows are a deterministic function of (buffer, position, token id), so any worker can recompute
what a prompt's KV must be. Output tokens are a function of the KV bytes the worker actually holds
(a CRC over every row of the sequence, read from the pool at the sequence's first sample in this
worker; later steps fold in only their new rows), so a decode worker that received wrong or missing
KV produces different tokens. ``verify`` lets the decode side check imported KV against
the prompt instead of assuming it arrived intact.

Options (``EngineOptions.extra``, ``--engine-option KEY=VALUE`` on the worker):
- ``layers`` (4), ``kv_heads`` (2), ``head_dim`` (16), ``max_context`` (8192): the model's shape.
- ``prefill_token_s`` (2e-5), ``decode_step_s`` (5e-4), ``decode_seq_s`` (5e-5): the latency
  model; a step sleeps for what it would have cost. 0 everywhere leaves the serving stack's own cost.
- ``kv_salt`` (0): mixed into every KV row (tests make workers whose KV disagree).
- ``verify_kv`` (1): 0 skips writing KV rows, reading them back and verifying imported KV (for
  benchmarks of the stack: at zero model cost that work is most of a worker's CPU). Output tokens
  are then a function of the sequence's previous token and its position: still deterministic, the
  same on a combined worker as through prefill + decode, but blind to the KV bytes held; ``verify``
  and ``digest`` answer None (not checked) and pages hold whatever they held before.

Lifecycle: construct from ``EngineOptions`` -> ``bind`` -> ``forward`` per step (sleeps for the
modelled compute time) -> ``close``.

Sampling fields: ``min_new_tokens`` is honoured (a stop token id the digest picks before it is replaced by the
next unbanned one; the sim never emits EOS); ``logit_bias`` and the penalties need logits, which the sim
does not have: requests that set them are refused with a 400 naming the field.
"""

from __future__ import annotations

import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator

import numpy as np

from workers.engines.base import Engine, EngineOptions, ModelInfo, SeqInput, SeqOutput, banned_by_min_tokens
from workers.kv_pool import KVPool

# Output alphabet: printable, so sim completions read as text through the byte tokenizer.
ALPHABET = b"abcdefghijklmnopqrstuvwxyz     ,."
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MAX_SEEN = 8192  # sequences whose running digest is kept


class SimEngine(Engine):
    name = "sim"
    # No logits, so no logit_bias or penalties (refused: ``check_sampling``); min_new_tokens is honoured.
    supported_sampling = frozenset({"min_new_tokens"})

    def __init__(self, options: EngineOptions | None = None) -> None:
        options = options or EngineOptions()
        extra = options.extra
        self.prefill_token_s = float(extra.get("prefill_token_s", 2e-5))
        self.decode_step_s = float(extra.get("decode_step_s", 5e-4))
        self.decode_seq_s = float(extra.get("decode_seq_s", 5e-5))
        self.kv_salt = int(extra.get("kv_salt", 0))
        verify_kv = str(extra.get("verify_kv", "1")).strip().lower()
        if verify_kv not in ("0", "1", "false", "true"):
            raise ValueError(f"sim engine option verify_kv must be 0 or 1, got {extra['verify_kv']!r}")
        self.verify_kv = verify_kv in ("1", "true")
        self.info = ModelInfo(
            name=options.model or "sim",
            num_layers=int(extra.get("layers", 4)),
            num_kv_heads=int(extra.get("kv_heads", 2)),
            head_dim=int(extra.get("head_dim", 16)),
            kv_dtype="float32",
            vocab_size=258,
            max_context=int(extra.get("max_context", 8192)),
            eos_token_ids=(257,),
            tokenizer="byte",
        )
        self._pool: KVPool | None = None
        self._seen: OrderedDict[int, tuple[int, list[int]]] = OrderedDict()  # seq -> rows folded, CRCs

    @property
    def pool(self) -> KVPool:
        if self._pool is None:
            raise RuntimeError("SimEngine.bind(pool) was not called")
        return self._pool

    def bind(self, pool: KVPool) -> None:
        if pool.dtype != "float32" or pool.token_bytes % 8:
            raise ValueError("the sim engine needs a float32 pool with 8-byte-aligned rows")
        self._pool = pool

    # -- KV content ---------------------------------------------------------------------------
    def expected_rows(self, buffer_index: int, start: int, token_ids: list[int]) -> np.ndarray:
        """The KV rows (as uint64 words) positions start.. of these tokens must hold."""
        words = self.pool.token_bytes // 8
        positions = np.arange(start, start + len(token_ids), dtype=np.uint64)
        tokens = np.asarray(token_ids, dtype=np.uint64)
        seed = (tokens * np.uint64(1_000_003) + positions * np.uint64(7919)) ^ np.uint64(
            (buffer_index + 1) * 104_729 + self.kv_salt
        )
        lanes = np.arange(1, words + 1, dtype=np.uint64)
        with np.errstate(over="ignore"):
            return (seed[:, None] * _MIX + lanes[None, :] * _MIX) ^ (seed[:, None] >> np.uint64(29))

    def _row_slices(self, page_ids: list[int], start: int, count: int) -> Iterator[tuple[int, int, int, int]]:
        """Yield (page, first row, n rows, offset into the token range) covering the positions."""
        size = self.pool.page_size
        pos, done = start, 0
        while done < count:
            page, row = page_ids[pos // size], pos % size
            n = min(size - row, count - done)
            yield page, row, n, done
            pos += n
            done += n

    def _write(self, seq: SeqInput) -> None:
        pool = self.pool
        for b, buf in enumerate(pool.kv_buffers()):
            rows = self.expected_rows(b, seq.num_cached, seq.token_ids)
            flat = buf.view(np.uint64).reshape(pool.num_pages, pool.page_size, -1)
            for page, row, n, off in self._row_slices(seq.page_ids, seq.num_cached, len(seq.token_ids)):
                flat[page, row : row + n] = rows[off : off + n]

    def _fold(self, page_ids: list[int], start: int, end: int, crcs: list[int]) -> list[int]:
        """Extend one CRC32 per buffer with the rows of positions [start, end), as held in the pool."""
        pool = self.pool
        out = []
        for buf, crc in zip(pool.kv_buffers(), crcs, strict=True):
            raw = buf.view(np.uint8).reshape(pool.num_pages, pool.page_size, -1)
            for page, row, n, _ in self._row_slices(page_ids, start, end - start):
                crc = zlib.crc32(raw[page, row : row + n].tobytes(), crc)
            out.append(crc)
        return out

    @staticmethod
    def _combine(crcs: list[int]) -> int:
        return zlib.crc32(np.asarray(crcs, dtype=np.uint32).tobytes())

    def digest(self, page_ids: list[int], num_tokens: int) -> int | None:
        """A CRC over every KV row of positions [0, num_tokens), as held in the pool (None: not checked)."""
        if not self.verify_kv:
            return None
        return self._combine(self._fold(page_ids, 0, num_tokens, [0] * 2 * self.pool.num_layers))

    def _sample_digest(self, seq: SeqInput) -> int:
        """``digest`` of the sequence, folding in only rows not seen at its previous sample.

        The first sample of a sequence in this worker (the prefill's last chunk, or the decode's
        first step after importing KV) reads every row from the pool; later steps add their rows. A request
        preempted and computed again (its pages new, or shared from the cache) is read again from its first row.
        """
        end = seq.num_cached + len(seq.token_ids)
        seen = self._seen.pop(seq.rid, None)
        if seen is not None and seq.num_cached == seen[0]:  # (a step right after the last: else a recompute)
            crcs = self._fold(seq.page_ids, seen[0], end, seen[1])
        else:
            crcs = self._fold(seq.page_ids, 0, end, [0] * 2 * self.pool.num_layers)
        self._seen[seq.rid] = (end, crcs)
        while len(self._seen) > _MAX_SEEN:
            self._seen.popitem(last=False)
        return self._combine(crcs)

    def forget(self, seq_id: int) -> None:
        """The scheduler released the sequence (``SequenceState``): drop its running digest (else every finished
        request's entry stayed until ``_MAX_SEEN`` newer ones pushed it out, a few MiB per worker)."""
        self._seen.pop(seq_id, None)

    def verify(self, page_ids: list[int], token_ids: list[int]) -> bool | None:
        """Whether the pool holds exactly the KV these tokens produce at positions 0.. (None: not checked)."""
        if not self.verify_kv:
            return None
        pool = self.pool
        for b, buf in enumerate(pool.kv_buffers()):
            expected = self.expected_rows(b, 0, token_ids)
            flat = buf.view(np.uint64).reshape(pool.num_pages, pool.page_size, -1)
            for page, row, n, off in self._row_slices(page_ids, 0, len(token_ids)):
                if not np.array_equal(flat[page, row : row + n], expected[off : off + n]):
                    return False
        return True

    # -- Engine --------------------------------------------------------------------------------
    def forward(self, batch: list[SeqInput]) -> list[SeqOutput]:
        started = time.perf_counter()
        outputs = []
        num_prefill_tokens = 0
        num_decode = 0
        for seq in batch:
            if seq.num_cached + len(seq.token_ids) > len(seq.page_ids) * self.pool.page_size:
                raise ValueError(f"request {seq.rid}: page table too short for its positions")
            if self.verify_kv:
                self._write(seq)
            if len(seq.token_ids) == 1 and seq.num_cached > 0:
                num_decode += 1
            else:
                num_prefill_tokens += len(seq.token_ids)
            if seq.sample:
                crc = self._sample_digest(seq) if self.verify_kv else _chain(seq)
                outputs.append(SeqOutput(token_id=self._pick(seq, crc), logprob=0.0))
            else:  # a prompt chunk: the rows of a recomputed request (preempted) are all read again at its sample
                self._seen.pop(seq.rid, None)
                outputs.append(SeqOutput())
        modelled = num_prefill_tokens * self.prefill_token_s
        if num_decode:
            modelled += self.decode_step_s + num_decode * self.decode_seq_s
        remaining = modelled - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
        return outputs


    def _pick(self, seq: SeqInput, crc: int) -> int:
        """The output token for this digest; under ``min_new_tokens`` the next one not banned."""
        token = ALPHABET[crc % len(ALPHABET)]
        p = seq.params
        if not p.min_new_tokens:
            return token
        banned = set(banned_by_min_tokens(p, seq.num_generated + p.output_offset, self.info.eos_token_ids))
        if token not in banned:
            return token
        candidates = [ALPHABET[(crc + k) % len(ALPHABET)] for k in range(len(ALPHABET))] + list(range(256))
        return next((t for t in candidates if t not in banned), token)


def _chain(seq: SeqInput) -> int:
    """``verify_kv=0``: a 32-bit mix of the sequence's last token and its position (no KV read)."""
    position = seq.num_cached + len(seq.token_ids) - 1
    h = ((seq.token_ids[-1] + 1) * 1_000_003 + position * 7919) * 0x9E3779B1 & 0xFFFFFFFF
    return h ^ (h >> 16)
