"""``TorchEngine``: the Llama-family model behind the scheduler's ``Engine`` seam.

Lifecycle:
1. ``TorchEngine(options)`` sets the thread count, reads ``config.json`` (``ModelConfigError`` for
   a missing or unsupported model), loads the weights and sets ``info``. ``options.model`` is an
   HF-style directory; None means the embedded SmolLM2 (converted from its GGUF once, cached).
2. ``bind(pool)`` wraps the pool's per-layer K/V buffers zero-copy (numpy memory via
   ``torch.from_numpy``; bfloat16 words viewed as ``torch.bfloat16``) and binds the attention
   backend to them.
3. ``forward(batch)`` from the scheduler thread, once per step: validates the batch, runs the model
   over every sequence's new tokens at once (KV written to the pages the scheduler named),
   samples where asked, and returns one ``SeqOutput`` per ``SeqInput``. After each call
   ``last_logits[i]`` holds the float32 logits ``[vocab]`` that sequence i's token was sampled
   from (None where ``sample`` was False): tests compare them with a reference. They are the model's
   raw logits; ``logit_bias``, penalties and ``min_new_tokens`` (``penalties.py``) are applied after,
   then a request's grammar (``constrained.py``) bans every token its output may not continue with.
4. ``forget(seq_id)`` from the scheduler when it releases a sequence (its penalty counts).
5. ``close()`` drops the weights and the cache views.

Prompt logprobs (``params.prompt_logprobs`` on a prefill chunk, i.e. ``num_generated == 0``):
``SeqOutput.prompt_logprobs[j]`` is the logprob of ``token_ids[j]`` given all earlier positions;
NaN for position 0 (nothing precedes it; msgspec JSON writes NaN as null). For a chunk that starts
after cached positions the first entry needs the previous position's final hidden state: after an
earlier chunk of the same rid on this engine it is carried over (kept for at most 1024 requests
mid-prefill); otherwise (prefix-cache hit) the previous token, from ``all_token_ids``, is re-run
as an extra query row whose KV is not rewritten; with neither, that entry is NaN. Positions before
``params.prompt_logprobs_start`` are NaN and not scored (a chunk that ends before it is not looked at).
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import secrets
import threading
from bisect import bisect_left
from dataclasses import dataclass

import torch

from workers.engines.base import OPTIONAL_SAMPLING, Engine, EngineOptions, ModelInfo, SeqInput, SeqOutput
from workers.engines.llama.attention import AttentionBackend, StepLayout, make_backend
from workers.engines.llama.config import ModelConfigError, load_config
from workers.engines.llama.constrained import Constraints
from workers.engines.llama.model import LlamaModel
from workers.engines.llama.penalties import LogitAdjuster
from workers.engines.llama.sampling import generator_for, is_greedy, sample, token_logprobs
from workers.kv_pool import KVPool
from workers.protocol import Grammar, TokenLogprob

log = logging.getLogger("workers.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PROMPT_LOGPROB_BLOCK = 256  # rows per LM-head block when scoring a prompt chunk
_MAX_PROMPT_CARRY = 1024  # prompt-logprob requests mid-prefill whose last hidden row is kept


@dataclass
class _SeqRows:
    start: int  # first row of this sequence in the flattened batch
    num_rows: int
    extra_row: bool  # row 0 re-runs position num_cached - 1 for prompt logprobs


class TorchEngine(Engine):
    """A real Llama-family transformer over the worker's paged KV pool."""

    name = "torch"
    supported_sampling = frozenset(OPTIONAL_SAMPLING)

    def __init__(self, options: EngineOptions) -> None:
        if options.num_threads > 0:
            torch.set_num_threads(options.num_threads)
        self._threads_applied_in = threading.get_ident()
        if options.dtype not in DTYPES:
            raise ModelConfigError(f"unsupported dtype {options.dtype!r}; choose one of {', '.join(DTYPES)}")
        self.options = options
        device = torch.device(options.device)
        if device.type == "cuda" and device.index is None:  # ("cuda": the current one, as tensors report it)
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.dtype = DTYPES[options.dtype]
        model_dir = options.model
        default_name = None
        if model_dir is None:
            from workers.engines.llama.gguf_convert import DEFAULT_MODEL_NAME, default_model_dir

            model_dir, default_name = default_model_dir(), DEFAULT_MODEL_NAME
        self.model_dir = os.path.abspath(model_dir)
        self.cfg = load_config(self.model_dir)
        self.model = LlamaModel.load(self.model_dir, self.cfg, self.dtype, self.device)
        self.attention: AttentionBackend = make_backend(options.attention, self.device)
        self.info = ModelInfo(
            name=options.extra.get("served_model_name")
            or default_name
            or os.path.basename(os.path.normpath(self.model_dir)),
            num_layers=self.cfg.num_layers,
            num_kv_heads=self.cfg.num_kv_heads,
            head_dim=self.cfg.head_dim,
            kv_dtype=options.dtype,
            vocab_size=self.cfg.vocab_size,
            max_context=self.cfg.max_context,
            eos_token_ids=self.cfg.eos_token_ids,
            tokenizer=self.model_dir,
        )
        self.pool: KVPool | None = None
        self.last_logits: list[torch.Tensor | None] = []
        self._rng = torch.Generator(device="cpu")
        self.adjuster = LogitAdjuster(self.cfg.vocab_size, self.cfg.eos_token_ids)
        self.constraints = Constraints(self.model_dir, self.cfg.vocab_size, self.cfg.eos_token_ids)
        # (rid, next position) -> final hidden row of the previous prompt chunk (prompt logprobs)
        self._prompt_carry: dict[tuple[int, int], torch.Tensor] = {}
        self._rng.manual_seed(secrets.randbits(63))

    # -- Engine seam --------------------------------------------------------------------------
    def bind(self, pool: KVPool) -> None:
        expected = (self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, self.options.dtype)
        got = (pool.num_layers, pool.num_kv_heads, pool.head_dim, pool.dtype)
        if got != expected:
            raise ValueError(
                f"KV pool shape (layers, kv_heads, head_dim, dtype)={got} does not match the model's {expected}"
            )
        k_caches = [self._wrap(buf) for buf in pool.k]
        v_caches = [self._wrap(buf) for buf in pool.v]
        self.attention.bind(k_caches, v_caches, self.cfg.num_heads)
        self.pool = pool

    def _wrap(self, buffer: object) -> torch.Tensor:
        tensor = buffer if isinstance(buffer, torch.Tensor) else torch.from_numpy(buffer)
        if self.dtype == torch.bfloat16 and tensor.dtype == torch.uint16:
            tensor = tensor.view(torch.bfloat16)
        if tensor.device != self.device:
            raise ValueError(
                f"KV pool memory is on {tensor.device}, the engine runs on {self.device}: "
                "build the pool on the engine's device"
            )
        return tensor

    def forget(self, seq_id: int) -> None:
        """The scheduler released ``seq_id``: drop its penalty counts (``SequenceState``), its grammar and
        a prompt-logprobs row carried to a next chunk that will not come (aborted mid-prompt)."""
        self.adjuster.forget(seq_id)
        self.constraints.forget(seq_id)
        if self._prompt_carry:
            for key in [key for key in self._prompt_carry if key[0] == seq_id]:
                del self._prompt_carry[key]

    def prepare(self, grammar: Grammar) -> concurrent.futures.Future[None]:
        """Compile ``grammar`` off the scheduler thread (``workers.grammar.GrammarCompiling``)."""
        return self.constraints.prepare(grammar)

    def close(self) -> None:
        self.pool = None
        self.last_logits = []
        self._prompt_carry.clear()
        self.constraints.close()

    # -- one step -----------------------------------------------------------------------------
    def forward(self, batch: list[SeqInput]) -> list[SeqOutput]:
        if self.pool is None:
            raise RuntimeError("TorchEngine.forward before bind(pool)")
        if self._threads_applied_in != threading.get_ident() and self.options.num_threads > 0:
            # OpenMP thread counts are per calling thread: apply ours in the scheduler's thread too.
            torch.set_num_threads(self.options.num_threads)
            self._threads_applied_in = threading.get_ident()
        self.last_logits = [None] * len(batch)
        if not batch:
            return []
        for seq in batch:
            self._validate(seq)
        tokens: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        write_rows: list[int] = []
        rows: list[_SeqRows] = []
        page_size = self.pool.page_size
        for seq in batch:
            start = len(tokens)
            extra = (
                self._wants_prompt_logprobs(seq)
                and seq.num_cached > 0
                and seq.num_cached >= seq.params.prompt_logprobs_start  # (the re-run row scores position num_cached)
                and seq.all_token_ids is not None
                and (seq.rid, seq.num_cached) not in self._prompt_carry
            )
            if extra:
                assert seq.all_token_ids is not None
                tokens.append(seq.all_token_ids[seq.num_cached - 1])
                positions.append(seq.num_cached - 1)
            for offset, token in enumerate(seq.token_ids):
                pos = seq.num_cached + offset
                write_rows.append(len(tokens))
                tokens.append(token)
                positions.append(pos)
                write_slots.append(seq.page_ids[pos // page_size] * page_size + pos % page_size)
            rows.append(_SeqRows(start, len(tokens) - start, extra))

        device = self.device
        step = StepLayout(
            query_lens=[r.num_rows for r in rows],
            kv_lens=[seq.num_cached + len(seq.token_ids) for seq in batch],
            page_ids=[seq.page_ids for seq in batch],
            write_slots=torch.tensor(write_slots, dtype=torch.int64, device=device),
            write_rows=(
                None if len(write_rows) == len(tokens) else torch.tensor(write_rows, dtype=torch.int64, device=device)
            ),
        )
        self.attention.plan(step)
        hidden = self.model.hidden(
            torch.tensor(tokens, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            self.attention,
        )
        outputs = [SeqOutput() for _ in batch]
        self._sample(batch, rows, hidden, outputs)
        # The rows this batch carries on from earlier chunks, taken out first: the rows its own chunks keep
        # for their next ones may evict the oldest, which must not be one of these (decided above: no extra row)
        carried = {(seq.rid, seq.num_cached): self._prompt_carry.pop((seq.rid, seq.num_cached))
                   for seq, r in zip(batch, rows, strict=True) if not r.extra_row and seq.num_cached > 0
                   and self._wants_prompt_logprobs(seq) and (seq.rid, seq.num_cached) in self._prompt_carry}
        for i, seq in enumerate(batch):
            if self._wants_prompt_logprobs(seq):
                outputs[i].prompt_logprobs, outputs[i].prompt_top_logprobs = self._prompt_logprobs(
                    seq, rows[i], hidden, carried.get((seq.rid, seq.num_cached)))
        if device.type == "cuda":
            # A chunk that samples nothing has not waited for its kernels, and the transfer layer reads its
            # KV pages (another stream, another process) as soon as forward returns.
            torch.cuda.current_stream(device).synchronize()
        return outputs

    def _validate(self, seq: SeqInput) -> None:
        assert self.pool is not None
        if not seq.token_ids:
            raise ValueError(f"rid {seq.rid}: no new tokens in this step")
        if seq.num_cached < 0:
            raise ValueError(f"rid {seq.rid}: num_cached must be >= 0, got {seq.num_cached}")
        kv_len = seq.num_cached + len(seq.token_ids)
        if kv_len > len(seq.page_ids) * self.pool.page_size:
            raise ValueError(
                f"rid {seq.rid}: {kv_len} positions need {self.pool.pages_for(kv_len)} pages, "
                f"the page table has {len(seq.page_ids)}"
            )
        if kv_len > self.cfg.max_context:
            raise ValueError(f"rid {seq.rid}: {kv_len} positions exceed max_context {self.cfg.max_context}")
        vocab = self.cfg.vocab_size
        if min(seq.token_ids) < 0 or max(seq.token_ids) >= vocab:
            raise ValueError(f"rid {seq.rid}: token id out of range [0, {vocab})")
        used = seq.page_ids[: -(-kv_len // self.pool.page_size)]  # pages this step reads or writes
        if min(used) < 0 or max(used) >= self.pool.num_pages:
            raise ValueError(f"rid {seq.rid}: page id out of range [0, {self.pool.num_pages})")
        cached_ids = seq.all_token_ids if self._wants_prompt_logprobs(seq) and seq.num_cached > 0 else None
        if cached_ids is not None and (
            len(cached_ids) < seq.num_cached or not 0 <= cached_ids[seq.num_cached - 1] < vocab
        ):
            raise ValueError(f"rid {seq.rid}: all_token_ids does not cover the cached positions")

    @staticmethod
    def _wants_prompt_logprobs(seq: SeqInput) -> bool:
        """A prompt chunk of a request for prompt logprobs that reaches their start (a chunk ending right before
        it keeps its last row for the next one)."""
        params = seq.params
        return (params.prompt_logprobs and seq.num_generated == 0
                and seq.num_cached + len(seq.token_ids) >= params.prompt_logprobs_start)

    def _sample(
        self, batch: list[SeqInput], rows: list[_SeqRows], hidden: torch.Tensor, outputs: list[SeqOutput]
    ) -> None:
        sampled = [i for i, seq in enumerate(batch) if seq.sample]
        if not sampled:
            return
        last_rows = torch.tensor([rows[i].start + rows[i].num_rows - 1 for i in sampled], device=self.device)
        logits = self.model.logits(hidden.index_select(0, last_rows)).cpu()
        # logit_bias, penalties, min_new_tokens over every sampled row at once (raw logits kept for logprobs)
        seqs = [batch[i] for i in sampled]
        scores = self.adjuster.adjust(logits, seqs)
        scores, failures = self.constraints.mask(seqs, scores, logits)  # grammars: banned tokens at -inf
        # One pass for every greedy sequence: its token, and whether its row can give one (a row with a NaN or
        # +inf score, or none finite, every token banned, has a non-finite maximum: max propagates NaN)
        best, top = scores.max(dim=-1)
        argmax, unusable = top.tolist(), (~torch.isfinite(best)).tolist()
        for j, i in enumerate(sampled):
            seq, row = batch[i], logits[j]
            self.last_logits[i] = row
            token: int | None
            if j in failures:
                outputs[i].error = failures[j]
                token = None
            elif is_greedy(seq.params):
                if unusable[j]:  # (the sampled path's check, ``sample``: this request fails, not the batch)
                    log.warning("rid %s: cannot take a greedy token: its scores are not finite", seq.rid)
                    token = None
                else:
                    token = argmax[j]
            else:
                try:
                    token = sample(scores[j], seq.params, generator_for(seq.params, seq.num_generated, self._rng))
                except RuntimeError as exc:  # (no finite probability: NaN scores) this request fails, not the batch
                    log.warning("rid %s: cannot sample a token: %s", seq.rid, exc)
                    token = None
            out = outputs[i]
            out.token_id = token
            if token is None:
                continue
            if seq.params.logprobs or seq.params.top_logprobs > 0:
                out.logprob, out.top_logprobs = token_logprobs(row, token, seq.params.top_logprobs)
        failed = self.constraints.accept(seqs, [outputs[i].token_id for i in sampled])
        for j, why in failed.items():
            out = outputs[sampled[j]]
            out.token_id, out.error = None, why

    def _prompt_logprobs(self, seq: SeqInput, rows: _SeqRows, hidden: torch.Tensor, carried: torch.Tensor | None,
                         ) -> tuple[list[float], list[list[TokenLogprob]] | None]:
        """Logprob of each chunk token given its prefix (NaN where the prefix's row is unknown, and before
        ``params.prompt_logprobs_start``: not scored), and with
        ``top_logprobs`` the most likely tokens there ([] where unknown); ``carried``: the previous chunk's
        last row (kept for this one)."""
        n = len(seq.token_ids)
        result = [math.nan] * n
        num_top = seq.params.top_logprobs
        tops: list[list[TokenLogprob]] | None = [[] for _ in range(n)] if num_top > 0 else None
        if not seq.sample:  # more prompt chunks follow: keep this chunk's last row for the next one
            if len(self._prompt_carry) >= _MAX_PROMPT_CARRY:
                self._prompt_carry.pop(next(iter(self._prompt_carry)))
            last = hidden[rows.start + rows.num_rows - 1].clone()
            self._prompt_carry[(seq.rid, seq.num_cached + n)] = last
        # Row r predicts the token at the next position: pairs (hidden row, index into token_ids).
        if rows.extra_row:
            sources = hidden[rows.start : rows.start + n]
            targets = list(range(n))
        else:
            sources = hidden[rows.start : rows.start + n - 1]
            targets = list(range(1, n))
            if carried is not None:
                sources = torch.cat([carried[None], sources])
                targets = [0, *targets]
        skip = bisect_left(targets, seq.params.prompt_logprobs_start - seq.num_cached)  # (targets ascend)
        if skip:
            sources, targets = sources[skip:], targets[skip:]
        for begin in range(0, len(targets), _PROMPT_LOGPROB_BLOCK):
            block = targets[begin : begin + _PROMPT_LOGPROB_BLOCK]
            ids = torch.tensor([seq.token_ids[j] for j in block], device=self.device)
            logprobs = torch.log_softmax(self.model.logits(sources[begin : begin + len(block)]), dim=-1)
            picked = logprobs.gather(1, ids[:, None])[:, 0].tolist()
            for j, value in zip(block, picked, strict=True):
                result[j] = float(value)
            if tops is not None:
                values, top_ids = torch.topk(logprobs, min(num_top, logprobs.shape[-1]), dim=-1)
                for j, row_ids, row_values in zip(block, top_ids.tolist(), values.tolist(), strict=True):
                    tops[j] = [TokenLogprob(t, float(v)) for t, v in zip(row_ids, row_values, strict=True)]
        return result, tops
